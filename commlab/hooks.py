"""commlab.hooks: DDP communication hooks (the code lives in commlab/training/hooks.py)."""
from commlab.training.hooks import (  # noqa: F401
    CommState,
    allreduce_hook,
    blocking_allreduce_hook,
    noop_hook,
    register,
)

__all__ = ["CommState", "register", "allreduce_hook", "blocking_allreduce_hook", "noop_hook"]
