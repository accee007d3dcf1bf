"""native/setup.py builds only the library this CPU loads (as torch reports the CPU), builds
what MOONCAKE_OPS_NATIVE_ISAS names instead, and refuses a CPU with neither ISA or an unknown
name with a message that says what is allowed. Nothing is compiled here: ``setup.py --name``
runs the choice and prints the distribution's name."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

NATIVE = Path(__file__).resolve().parents[1] / "native"


def setup_py(capability: str | None, isas: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("ATEN_CPU_CAPABILITY", "MOONCAKE_OPS_NATIVE_ISAS")}
    if capability is not None:
        env["ATEN_CPU_CAPABILITY"] = capability  # torch's own override of its CPU capability
    if isas is not None:
        env["MOONCAKE_OPS_NATIVE_ISAS"] = isas
    code = ("import runpy, sys; sys.argv = ['setup.py', '--name']; "
            "print(runpy.run_path('setup.py')['chosen_isas']())")
    return subprocess.run([sys.executable, "-c", code], cwd=NATIVE, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(("capability", "isas", "chosen"), [
    ("avx2", None, "['avx2']"), ("avx512", None, "['avx512']"),
    ("avx2", "avx512,avx2", "['avx512', 'avx2']"),
])
def test_one_library_for_this_cpu_or_the_named_ones(capability, isas, chosen):
    proc = setup_py(capability, isas)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["mooncake-ops-native", chosen]


def test_a_cpu_with_neither_isa_or_an_unknown_name_is_refused_by_name():
    neither = setup_py("default")
    assert neither.returncode != 0
    assert "torch reports neither AVX-512 nor AVX2" in neither.stderr
    assert "MOONCAKE_OPS_NATIVE_ISAS=avx512 or avx2" in neither.stderr
    unknown = setup_py(None, "avx9")
    assert unknown.returncode != 0
    assert "unknown ['avx9']; allowed: a comma-separated list of ['avx2', 'avx512']" in unknown.stderr

