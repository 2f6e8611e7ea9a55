"""Access to the compiled extension commlab._C."""
from __future__ import annotations

import torch  # noqa: F401  (loads libtorch before the extension needs it)

from commlab.core import cxx_runtime
from commlab.core.errors import CommlabError

try:
    from commlab import _C as C
except ImportError as e:  # pragma: no cover - only without a build
    C = None
    IMPORT_ERROR = e
else:
    IMPORT_ERROR = cxx_runtime.problem(C.__file__)
    if IMPORT_ERROR is not None:  # unusable: its first error would crash the process
        C = None

HAS_CUDA = bool(C is not None and C.has_cuda())


def require():
    if C is None:

        if isinstance(IMPORT_ERROR, str):
            raise CommlabError(f"commlab._C cannot be used: {IMPORT_ERROR}")
        raise CommlabError(
            "commlab._C is not built: run `pip install --no-build-isolation -e .` "
            f"({IMPORT_ERROR})"
        )
    return C


def reduce_n_serves(t: torch.Tensor) -> bool:
    if C is None:
        return False
    return t.device.type == "cpu" or (t.device.type == "cuda" and HAS_CUDA)
