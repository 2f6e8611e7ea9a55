"""Build commlab and its native extension commlab._C.

The pytorch/extension-cpp pattern: C++ sources always, CUDA sources when a CUDA build
of torch and a usable CUDA toolkit (nvcc and cuda_runtime.h) are both present
(COMMLAB_NO_CUDA=1 skips them). Build against the installed torch:
pip install --no-build-isolation -e .
"""
import glob
import os
import shutil
import subprocess
import sys

from setuptools import find_packages, setup


def _usable(root: str | None) -> bool:
    return bool(root) and os.path.isfile(os.path.join(root, "bin", "nvcc")) and \
        os.path.isfile(os.path.join(root, "include", "cuda_runtime.h"))


def _nvcc_root(nvcc: str) -> str | None:
    """Where an nvcc on PATH really lives: it may be a wrapper script in /usr/local/bin,
    whose parent torch would take for the toolkit (no headers there)."""
    try:
        out = subprocess.run([nvcc, "-v", "--dryrun", "x.cu"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    for line in (out.stdout + out.stderr).splitlines():
        if line.startswith("#$ TOP="):
            return os.path.normpath(line.split("=", 1)[1].strip())  # TOP is <root>/bin/..
    return None


def cuda_toolkit() -> str | None:
    """A usable toolkit's root, or None. An explicit CUDA_HOME / CUDA_PATH is the user's
    word: if it holds no toolkit, the build is C++ only (never a failed build)."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(var)
        if root:
            if _usable(root):
                return root
            print(f"commlab: {var}={root} holds no CUDA toolkit (bin/nvcc, include/cuda_runtime.h): "
                  "building the C++ sources only", file=sys.stderr)
            return None
    candidates = []
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates += [_nvcc_root(nvcc), os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))]
    candidates.append("/usr/local/cuda")
    return next((c for c in candidates if _usable(c)), None)


def want_cuda() -> bool:
    if os.environ.get("COMMLAB_NO_CUDA", "0") == "1":
        return False
    import torch

    if torch.version.cuda is None:
        return False
    root = cuda_toolkit()
    if root is None:
        print("commlab: no CUDA toolkit found: building the C++ sources only", file=sys.stderr)
        return False
    os.environ["CUDA_HOME"] = root  # before torch.utils.cpp_extension reads it
    return True


WITH_CUDA = want_cuda()
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402

VERSION = "0.1.0"
HERE = os.path.dirname(os.path.abspath(__file__))


def extension():
    cpp = sorted(glob.glob(os.path.join("csrc", "**", "*.cpp"), recursive=True))
    cu = sorted(glob.glob(os.path.join("csrc", "**", "*.cu"), recursive=True))
    # Portable code only: the wheel must run on any x86-64 host, so no -march=native;
    # vectorized paths are chosen at run time.
    cxx = ["-O3", f'-DCOMMLAB_VERSION="{VERSION}"']
    # No debug information unless asked for (COMMLAB_DEBUG=1): Python's flags carry -g, and
    # writing it for torch's headers was a third of the build.
    if os.environ.get("COMMLAB_DEBUG", "0") != "1":
        cxx.append("-g0")
    define = []
    if WITH_CUDA:
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


def _load_runtime_check():
    """commlab/core/cxx_runtime.py by path: the package cannot be imported before it is built."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("_commlab_cxx_runtime",
                                                  os.path.join(HERE, "commlab", "core", "cxx_runtime.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Build(BuildExtension):
    """torch's build, then a check that the extension shares the process's C++ runtime."""

    def build_extension(self, ext):
        super().build_extension(ext)
        path = self.get_ext_fullpath(ext.name)
        why = _load_runtime_check().problem(path)
        if why is not None:
            os.remove(path)
            raise SystemExit(f"commlab: {why}")


setup(
    name="commlab",
    version=VERSION,
    packages=find_packages(include=["commlab", "commlab.*"]),
    package_data={"commlab.experiments.predict": ["profiles/*.json"]},  # hardware profiles: data, not code
    ext_modules=[extension()],
    cmdclass={"build_ext": Build.with_options(use_ninja=True)},
)
