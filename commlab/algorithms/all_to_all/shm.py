"""Shared-memory all-to-all for CPU ranks on one host (commlab._C.ShmComm.alltoall): every
rank copies each block for a peer into its segment's slot for that peer, then reads its own
block straight from every peer's segment, and copies its block for itself straight from its
input to its output; the first piece carries every rank's counts, which
each rank checks as a whole before any byte lands, so splits that disagree fail alike on
every rank."""
from commlab.transports import shm

from ..base import Cost, Traffic
from ..family_shm import SharedMemoryMember
from .base import AllToAllAlgorithm


class SharedMemory(SharedMemoryMember, AllToAllAlgorithm):
    summary = "shared memory on one host: a peer's block one copy in, one copy out, one synchronisation per piece"
    fast_method = "try_alltoall"
    formula = "α + (2(p-1)+1)/p·nβ (the peers' blocks in and out, one's own straight); β is memory traffic"

    def cost(self, p, nbytes):
        return Cost(1, (2 * (p - 1) + 1) * nbytes / p, 0.0)

    def memory_traffic(self, p, nbytes):
        return Traffic(tensor=2 * nbytes, staging=2 * nbytes * (p - 1) / p)

    def run(self, out, inp, counts, ctx):
        shm.all_to_all(out, inp, counts.send, counts.recv, ctx.info, self.name)  # typed: the record names the dtype


ALGORITHM = SharedMemory()
