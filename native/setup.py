"""Build of mooncake_ops_native, the AVX-512 CPU kernels loaded by mooncake_ops when present.

    pip install --no-build-isolation ./native     (uses the torch already installed)
"""

from pathlib import Path

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

HERE = Path(__file__).parent
SOURCES = sorted(str(p.relative_to(HERE)) for p in (HERE / "csrc").glob("*.cpp"))
FLAGS = ["-O3", "-std=c++20", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
         "-mfma", "-mf16c", "-fno-math-errno",
         "-Wno-maybe-uninitialized", "-Wno-uninitialized"]

setup(
    ext_modules=[CppExtension("mooncake_ops_native", SOURCES, extra_compile_args=FLAGS,
                              extra_link_args=["-fopenmp"])],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
