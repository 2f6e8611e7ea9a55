"""The collectives commlab serves: one family of algorithms each (commlab/algorithms),
one record each in the call agreement (transports/p2p.py), one setting each for the
algorithm the commlab torch.distributed backend runs."""
import os

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")

# Each one's code in shared memory's call records (common/codes.h CallKind).
KIND = {"all_reduce": 0, "all_gather": 1, "reduce_scatter": 2, "broadcast": 3, "barrier": 4, "all_to_all": 5}

# Those whose result on every rank needs every rank's input: no rank can finish one
# without data from every peer, which the call check relies on (transports/p2p.py).
EVERY_INPUT_NEEDED = frozenset({"all_reduce", "all_gather", "reduce_scatter"})


def algorithm_setting(collective: str) -> str:
    """The environment variable naming the algorithm the commlab backend runs for a
    collective: COMMLAB_ALGORITHM for all-reduce (the first), COMMLAB_<COLLECTIVE>_ALGORITHM
    for the others."""
    return "COMMLAB_ALGORITHM" if collective == "all_reduce" else f"COMMLAB_{collective.upper()}_ALGORITHM"


def backend_algorithm(collective: str) -> str:
    """The algorithm the commlab backend runs for a collective now: its setting, else auto."""
    return os.environ.get(algorithm_setting(collective), "") or "auto"
