"""Each layer installs alone: pip install ./kthena_core and ./mooncake_kv into an empty venv.

Neither may pull torch or another of our layers; both must import afterwards. This is the slow
end-to-end check behind the README's claim (about a minute, mostly pip). And the root folder is
no package: pip stops at once with the README's full-stack recipe.
"""

import json
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def installed(python: Path) -> set[str]:
    out = subprocess.run([str(python), "-m", "pip", "list", "--format=json"], capture_output=True,
                         text=True, check=True).stdout
    return {p["name"].lower().replace("_", "-") for p in json.loads(out)}


@pytest.mark.slow
@pytest.mark.parametrize("layer", ["kthena_core", "mooncake_kv"])
def test_layer_installs_alone_without_torch(tmp_path, layer):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    proc = subprocess.run([str(python), "-m", "pip", "install", "-q", str(ROOT / layer)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = installed(python)
    assert layer.replace("_", "-") in names
    others = {"kthena-core", "kthena-comm", "mooncake-kv", "mooncake-ops", "kthena-serve", "torch"}
    assert not (names & others - {layer.replace("_", "-")}), names
    check = subprocess.run([str(python), "-c", f"import {layer}; print({layer}.__name__)"],
                           capture_output=True, text=True, cwd=tmp_path)
    assert check.returncode == 0, check.stderr[-3000:]


def test_root_is_refused_at_once_with_the_readme_recipe(tmp_path):
    """`pip install .` at the root must not look for the layers on PyPI: it stops and prints
    the README's recipe (tools/root_build.py). `make install`'s editable root install is the
    other path of that backend, exercised by every `make`."""
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-index",
                           "--no-build-isolation", "-w", str(tmp_path), str(ROOT)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and not list(tmp_path.iterdir())
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    recipe = readme[readme.index("## Install with pip"):readme.index("## Set-up for development")]
    pip_lines = [line.split("#")[0].strip() for line in recipe.splitlines()
                 if line.startswith("pip install")]
    assert len(pip_lines) == 4  # torch, the model, the layers, xgrammar without its deps
    printed = proc.stdout + proc.stderr
    for line in pip_lines:
        assert line in printed, (line, proc.stdout, proc.stderr)
    assert sorted(pip_lines, key=printed.index) == pip_lines  # in the README's order
