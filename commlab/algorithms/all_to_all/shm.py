"""Shared-memory all-to-all for CPU ranks on one host (commlab._C.ShmComm.alltoall): every
rank copies each block into its segment's slot for that peer, then reads its own block
straight from every peer's segment; the first piece carries every rank's counts, which
each rank checks as a whole before any byte lands, so splits that disagree fail alike on
every rank."""
from commlab.transports import shm

from ..base import Cost, Traffic
from .base import AllToAllAlgorithm


class SharedMemory(AllToAllAlgorithm):
    name = "shm"
    summary = "shared memory on one host: one copy in, one copy out, one synchronisation per piece"
    formula = "α + nβ(copy in) + nβ(copy out); β is memory traffic"
    wins_when = "ranks on one host: no sockets, no kernel copies"
    devices = ("cpu",)
    order = 60
    level = "shm"

    def cost(self, p, nbytes):
        return Cost(1, 2 * nbytes, 0.0)

    def memory_traffic(self, p, nbytes):
        return Traffic(tensor=2 * nbytes, staging=2 * nbytes)

    def unsupported(self, inp, info):
        return shm.unsupported(info)

    def checks_calls(self, ctx):
        return True

    def fast_call(self, like, op, ctx):
        return shm.fast_call(ctx.info, self.name, "try_alltoall", like)

    def run(self, out, inp, counts, ctx):
        shm.all_to_all(out, inp, counts.send, counts.recv, ctx.info, self.name)  # typed: the record names the dtype


ALGORITHM = SharedMemory()
