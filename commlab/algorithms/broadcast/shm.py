"""Shared-memory broadcast for CPU ranks on one host (commlab._C.ShmComm.broadcast): the
root copies the message into its segment piece by piece, every other rank copies it out;
every piece carries the call's record (size, dtype, root), so ranks that call
differently fail alike before any wrong byte lands."""
from commlab.transports import shm

from ..base import Cost, Traffic
from ..family_shm import SharedMemoryMember
from .base import BroadcastAlgorithm


class SharedMemory(SharedMemoryMember, BroadcastAlgorithm):
    summary = "shared memory on one host: the root copies in once, every rank copies out"
    fast_method = "try_broadcast"
    formula = "α + 2nβ (copy in, copy out); β is memory traffic"

    def cost(self, p, nbytes):
        return Cost(1, 2 * nbytes, 0.0)

    def memory_traffic(self, p, nbytes):
        return Traffic(tensor=nbytes, staging=nbytes)

    def run(self, buf, root, ctx):
        shm.broadcast(buf, root, ctx.info, self.name)


ALGORITHM = SharedMemory()
