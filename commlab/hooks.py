"""commlab.hooks: DDP communication hooks (the code lives in commlab/training/hooks.py)."""
from commlab.training.hooks import CommState, allreduce_hook, blocking_allreduce_hook, noop_hook, register  # noqa: F401

__all__ = ["CommState", "register", "allreduce_hook", "blocking_allreduce_hook", "noop_hook"]
