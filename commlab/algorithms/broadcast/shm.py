"""Shared-memory broadcast for CPU ranks on one host (commlab._C.ShmComm.broadcast): the
root copies the message into its segment piece by piece, every other rank copies it out;
every piece carries the call's record (size, dtype, root), so ranks that call
differently fail alike before any wrong byte lands."""
from commlab.transports import shm

from ..base import Cost, Traffic
from .base import BroadcastAlgorithm


class SharedMemory(BroadcastAlgorithm):
    name = "shm"
    summary = "shared memory on one host: the root copies in once, every rank copies out"
    formula = "α + 2nβ (copy in, copy out); β is memory traffic"
    wins_when = "ranks on one host: no sockets, no kernel copies"
    devices = ("cpu",)
    order = 60
    level = "shm"

    def cost(self, p, nbytes):
        return Cost(1, 2 * nbytes, 0.0)

    def memory_traffic(self, p, nbytes):
        return Traffic(tensor=nbytes, staging=nbytes)

    def unsupported(self, buf, info):
        return shm.unsupported(info)

    def checks_calls(self, ctx):
        return True

    def fast_call(self, like, op, ctx):
        return shm.fast_call(ctx.info, self.name, "try_broadcast", like)

    def run(self, buf, root, ctx):
        shm.broadcast(buf, root, ctx.info, self.name)


ALGORITHM = SharedMemory()
