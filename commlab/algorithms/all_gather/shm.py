"""Shared-memory all-gather for CPU ranks on one host (commlab._C.ShmComm.allgather):
every rank copies its block into its segment once, then reads every peer's straight
into the output; every piece carries the call's record, so ranks that call differently
fail alike before any wrong byte lands."""
from commlab.transports import shm

from ..base import Cost, Traffic
from ..family_shm import SharedMemoryMember
from .base import AllGatherAlgorithm


class SharedMemory(SharedMemoryMember, AllGatherAlgorithm):
    summary = "shared memory on one host: one copy in, p copies out, one synchronisation per piece"
    fast_method = "try_allgather"
    formula = "α + n/p·β(copy in) + n·β(copy out); β is memory traffic"

    def cost(self, p, nbytes):
        return Cost(1, nbytes / p + nbytes, 0.0)

    def memory_traffic(self, p, nbytes):
        # The input is read once, the output written once; the segments take the
        # copy-in write and the peers' reads.
        return Traffic(tensor=nbytes / p + nbytes, staging=nbytes / p + nbytes)

    def run(self, out, inp, ctx):
        shm.all_gather(out, inp, ctx.info, self.name)  # typed: the record names the dtype


ALGORITHM = SharedMemory()
