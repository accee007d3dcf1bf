"""Build of the native CPU kernels mooncake_ops loads when present:

* ``mooncake_ops_native`` (csrc/): every kernel, AVX-512 throughout (AVX512_BF16 per function);
* ``mooncake_ops_native_avx2`` (csrc_avx2/): for CPUs with AVX2 + FMA + F16C but no AVX-512,
  where the first cannot load: all but the AVX512_BF16 kernels, plus a dense small-row matmul.

    pip install --no-build-isolation ./native     (uses the torch already installed)

``MOONCAKE_OPS_NATIVE_ISAS=avx512`` or ``=avx2`` builds only that one (``make install`` builds
the one this CPU loads); the default builds both.
"""

import os
from pathlib import Path

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

HERE = Path(__file__).parent
COMMON = ["-O3", "-std=c++20", "-fopenmp", "-fno-math-errno",
          "-Wno-maybe-uninitialized", "-Wno-uninitialized"]
MODULES = {  # isa -> (module, source folder, ISA flags)
    "avx512": ("mooncake_ops_native", "csrc",
               ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"]),
    "avx2": ("mooncake_ops_native_avx2", "csrc_avx2", ["-mavx2", "-mfma", "-mf16c"]),
}
ISAS = os.environ.get("MOONCAKE_OPS_NATIVE_ISAS", "avx512,avx2").split(",")
unknown = sorted(set(ISAS) - set(MODULES))
if unknown:
    raise SystemExit(f"MOONCAKE_OPS_NATIVE_ISAS: unknown {unknown}; allowed: {sorted(MODULES)}")


def extension(isa: str) -> CppExtension:
    name, folder, flags = MODULES[isa]
    sources = sorted(str(p.relative_to(HERE)) for p in (HERE / folder).glob("*.cpp"))
    return CppExtension(name, sources, extra_compile_args=COMMON + flags,
                        extra_link_args=["-fopenmp"])


setup(
    packages=[],  # only the extension modules (csrc folders are not Python packages)
    ext_modules=[extension(isa) for isa in ISAS],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
