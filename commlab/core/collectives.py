"""The collectives commlab serves: one family of algorithms each (commlab/algorithms),
one record each in the call agreement (transports/p2p.py)."""

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")

# Each one's code in shared memory's call records (common/codes.h CallKind).
KIND = {"all_reduce": 0, "all_gather": 1, "reduce_scatter": 2, "broadcast": 3, "barrier": 4, "all_to_all": 5}

# Those whose result on every rank needs every rank's input: no rank can finish one
# without data from every peer, which the call check relies on (transports/p2p.py).
EVERY_INPUT_NEEDED = frozenset({"all_reduce", "all_gather", "reduce_scatter"})
