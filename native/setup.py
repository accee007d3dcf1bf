"""Build of the native CPU kernels mooncake_ops loads when present:

* ``mooncake_ops_native`` (csrc/): every kernel, AVX-512 throughout (AVX512_BF16 per function);
* ``mooncake_ops_native_avx2`` (csrc_avx2/): for CPUs with AVX2 + FMA + F16C but no AVX-512,
  where the first cannot load: all but the AVX512_BF16 kernels, plus a dense small-row matmul.

    pip install --no-build-isolation ./native     (uses the torch already installed)

By default only the library this CPU loads is built (as torch's CPU capability reports it:
AVX-512 or AVX2), like ``make install``. ``MOONCAKE_OPS_NATIVE_ISAS=avx512``, ``=avx2`` or
``=avx512,avx2`` builds those instead (for another machine's CPU). A CPU with neither is
refused: mooncake_ops runs its PyTorch reference there. The build says what it builds and how
long it took (shown by ``pip install -v``, and in the log of a failed build).
"""

import os
import sys
import time
from pathlib import Path

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

HERE = Path(__file__).parent
# -g0 undoes the -g of Python's CFLAGS: debug info for torch's headers took half to two thirds
# of each file's compile time (decode_attention.cpp: 29.8 s with it, 10.6 s without, Zen 4).
COMMON = ["-O3", "-g0", "-std=c++20", "-fopenmp", "-fno-math-errno",
          "-Wno-maybe-uninitialized", "-Wno-uninitialized"]
MODULES = {  # isa -> (module, source folder, ISA flags)
    "avx512": ("mooncake_ops_native", "csrc",
               ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"]),
    "avx2": ("mooncake_ops_native_avx2", "csrc_avx2", ["-mavx2", "-mfma", "-mf16c"]),
}
ENV = "MOONCAKE_OPS_NATIVE_ISAS"


def this_cpu_isa() -> str | None:
    """The library this CPU loads, from torch's CPU capability (``AVX512`` / ``AVX2``)."""
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    return "avx512" if "AVX512" in capability else "avx2" if capability == "AVX2" else None


def chosen_isas() -> list[str]:
    """``$MOONCAKE_OPS_NATIVE_ISAS`` (checked), else this CPU's one library."""
    given = os.environ.get(ENV, "").strip()
    if given:
        isas = [isa.strip() for isa in given.split(",") if isa.strip()]
        unknown = sorted(set(isas) - set(MODULES))
        if unknown or not isas:
            raise SystemExit(f"{ENV}={given!r}: unknown {unknown}; allowed: a comma-separated "
                             f"list of {sorted(MODULES)}")
        return isas
    isa = this_cpu_isa()
    if isa is None:
        raise SystemExit("mooncake-ops-native: torch reports neither AVX-512 nor AVX2 on this "
                         "CPU, so no native library could load here (mooncake_ops runs its "
                         f"PyTorch reference); to build for another CPU set {ENV}=avx512 or avx2")
    return [isa]


def extension(isa: str) -> CppExtension:
    name, folder, flags = MODULES[isa]
    sources = sorted(str(p.relative_to(HERE)) for p in (HERE / folder).glob("*.cpp"))
    return CppExtension(name, sources, extra_compile_args=COMMON + flags,
                        extra_link_args=["-fopenmp"])


class TimedBuild(BuildExtension.with_options(use_ninja=True)):
    """torch's build, with a line before (what is built) and after (how long it took)."""

    def run(self) -> None:
        names = ", ".join(f"{e.name} ({len(e.sources)} files)" for e in self.extensions)
        jobs = os.environ.get("MAX_JOBS", f"{os.cpu_count()} (all cores)")
        print(f"mooncake-ops-native: building {names} with MAX_JOBS={jobs}", file=sys.stderr,
              flush=True)
        start = time.monotonic()
        super().run()
        print(f"mooncake-ops-native: built {names} in {time.monotonic() - start:.0f} s",
              file=sys.stderr, flush=True)


setup(
    packages=[],  # only the extension modules (csrc folders are not Python packages)
    ext_modules=[extension(isa) for isa in chosen_isas()],
    cmdclass={"build_ext": TimedBuild},
)
