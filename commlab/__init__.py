"""commlab: collective-communication research toolkit for PyTorch.

    import commlab
    commlab.all_reduce(t, algorithm="ring")      # same contract as dist.all_reduce
    commlab.all_gather(out, t, algorithm="rd")   # ... as dist.all_gather_into_tensor
    commlab.reduce_scatter(out, t, algorithm="rh")  # ... as dist.reduce_scatter_tensor
    commlab.broadcast(t, src=0, algorithm="binomial")  # ... as dist.broadcast
    commlab.all_to_all(out, t, algorithm="bruck")  # ... as dist.all_to_all_single
    commlab.algorithm_names()                    # what the registry holds
    dist.init_process_group("commlab")           # unchanged training code on commlab's algorithms
"""
import torch  # noqa: F401  (loads libtorch before commlab._C)

from commlab.api import backend as _backend
from commlab.api.all_gather import all_gather
from commlab.api.all_reduce import algorithm_names, all_reduce, get_algorithm
from commlab.api.all_to_all import all_to_all
from commlab.api.broadcast import broadcast
from commlab.api.reduce_scatter import reduce_scatter
from commlab.core.errors import (
    CollectiveMismatchError,
    CommlabError,
    PeerError,
    UnsupportedError,
)

__version__ = "0.1.0"

_backend.register()  # dist.init_process_group("commlab") / new_group(backend="commlab")

__all__ = [
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "all_to_all",
    "algorithm_names",
    "get_algorithm",
    "CommlabError",
    "UnsupportedError",
    "PeerError",
    "CollectiveMismatchError",
    "__version__",
]
