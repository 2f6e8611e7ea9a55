"""Build commlab and its native extension commlab._C.

The pytorch/extension-cpp pattern: C++ sources always, CUDA sources when both a CUDA
toolkit and a CUDA build of torch are present (COMMLAB_NO_CUDA=1 skips them).
Build against the installed torch: pip install --no-build-isolation -e .
"""
import glob
import os

from setuptools import find_packages, setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
import torch

VERSION = "0.1.0"
HERE = os.path.dirname(os.path.abspath(__file__))


def want_cuda() -> bool:
    if os.environ.get("COMMLAB_NO_CUDA", "0") == "1":
        return False
    return torch.version.cuda is not None and CUDA_HOME is not None


def extension():
    cpp = sorted(glob.glob(os.path.join("csrc", "**", "*.cpp"), recursive=True))
    cu = sorted(glob.glob(os.path.join("csrc", "**", "*.cu"), recursive=True))
    # Portable code only: the wheel must run on any x86-64 host, so no -march=native;
    # vectorized paths are chosen at run time.
    cxx = ["-O3", f'-DCOMMLAB_VERSION="{VERSION}"']
    define = []
    if want_cuda():
        nvcc = ["-O3", f'-DCOMMLAB_VERSION="{VERSION}"', "-DCOMMLAB_WITH_CUDA"]
        if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
            # Ampere through Hopper plus PTX, so the build needs no GPU to pick targets.
            os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;8.6;8.9;9.0+PTX"
        return CUDAExtension(
            "commlab._C",
            cpp + cu,
            define_macros=define + [("COMMLAB_WITH_CUDA", None)],
            extra_compile_args={"cxx": cxx, "nvcc": nvcc},
            libraries=["rt"],
        )
    return CppExtension("commlab._C", cpp, extra_compile_args={"cxx": cxx}, libraries=["rt"])


setup(
    name="commlab",
    version=VERSION,
    packages=find_packages(include=["commlab", "commlab.*"]),
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
