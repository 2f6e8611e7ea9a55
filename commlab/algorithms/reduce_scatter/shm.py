"""Shared-memory reduce-scatter for CPU ranks on one host (commlab._C.ShmComm.reduce_scatter):
every rank copies its input into its segment, then reduces its own block straight from
every peer's segment, in rank order; every piece carries the call's record, so ranks that
call differently fail alike before any wrong byte lands."""
from commlab.core.reduction import SUPPORTED_DTYPES
from commlab.transports import shm

from ..base import Cost, Traffic
from ..family_shm import SharedMemoryMember
from .base import ReduceScatterAlgorithm


class SharedMemory(SharedMemoryMember, ReduceScatterAlgorithm):
    summary = "shared memory on one host: one copy in, each rank reduces its block from every segment"
    fast_method = "try_reduce_scatter"
    formula = "α + nβ(copy in) + nβ(p reads of n/p) + (p-1)/p·nγ; β is memory traffic"

    def cost(self, p, nbytes):
        return Cost(1, 2 * nbytes, (p - 1) / p * nbytes)

    def memory_traffic(self, p, nbytes):
        return Traffic(tensor=nbytes + nbytes / p, staging=2 * nbytes)

    def unsupported(self, inp, op, info):
        if inp.dtype not in SUPPORTED_DTYPES:
            return f"dtype {inp.dtype} is not reduced in shared memory"
        return shm.unsupported(info)

    def run(self, out, inp, op, ctx):
        shm.reduce_scatter(out, inp, ctx.recorded(op), ctx.info, self.name)


ALGORITHM = SharedMemory()
