"""What the shared-memory algorithms of every family but all-reduce's share
(commlab._C.ShmComm): CPU ranks of one host, every piece carrying the call's record
(the transport checks calls itself), a fast path that is one C++ call; and what their
two-level (`hier`) algorithms share, which are `shm` on one host."""
from __future__ import annotations

from commlab.transports import shm


class SharedMemoryMember:
    """Mixed in before the family's base class; a family's own adds its cost, traffic,
    `run` and the name of ShmComm's fast method."""

    name = "shm"
    wins_when = "ranks on one host: no sockets, no kernel copies"
    devices = ("cpu",)
    order = 60
    level = "shm"
    fast_method = ""  # ShmComm's try_* for the family's calls

    def unsupported(self, *call) -> str | None:
        return shm.unsupported(call[-1])  # the group's facts come last in every family's call

    def checks_calls(self, ctx) -> bool:
        return True

    def fast_call(self, like, op, ctx):
        return shm.fast_call(ctx.info, self.name, self.fast_method, like, *(() if op is None else (int(op),)))


class HierarchicalMember:
    """Mixed in before the family's base class of a two-level algorithm: shared memory on
    each host, the hosts' leaders over the links; on one host it is the family's `shm`."""

    name = "hier"
    wins_when = "several ranks per host and a slow host link: each host's data crosses each link once"
    devices = ("cpu",)
    order = 65
    level = "shm"

    def cost(self, p, nbytes):
        from commlab.algorithms import (
            registry,  # the family's package imports this module
        )

        return registry(self.collective).get("shm").cost(p, nbytes)
