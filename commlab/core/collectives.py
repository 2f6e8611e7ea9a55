"""The collectives commlab serves: one family of algorithms each (commlab/algorithms),
one record each in the call agreement (transports/p2p.py)."""

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
