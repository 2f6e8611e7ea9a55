"""Shared-memory all-reduce for CPU ranks on one host (commlab._C.ShmComm): one-shot
(every rank reduces all inputs, one synchronisation) for small messages, two-shot
(reduce-scatter into one's own slot, then all-gather) for large ones."""
from dataclasses import replace

from commlab.transports import shm

from ..base import Algorithm, Cost, Traffic


class SharedMemory(Algorithm):
    name = "shm"
    summary = "shared memory on one host: one-shot below COMMLAB_SHM_ONESHOT_MAX, two-shot above"
    formula = ("one-shot: α + n·β(copy in) + (p-1)·nγ;  two-shot: 2α + 2n·β(copy in, copy out) + (p-1)/p·nγ; "
               "β, γ are memory traffic")
    wins_when = "ranks on one host: no sockets, no kernel copies, reductions read peers' memory directly"
    devices = ("cpu",)
    order = 60
    level = "shm"

    def stages(self, hosts, per_host, nbytes):
        st = super().stages(hosts, per_host, nbytes)
        return st and [replace(s, by="shm") for s in st]  # shm_ps too: one transport, one per-step cost
    mode = shm.Mode.AUTO

    def cost(self, p, nbytes):
        if nbytes <= shm.ONESHOT_MAX:
            return Cost(1, nbytes, (p - 1) * nbytes)
        return Cost(2, 2 * nbytes, (p - 1) / p * nbytes)

    def memory_traffic(self, p, nbytes):
        # The tensor is read once (copy in) and written once (reduce or copy out); the
        # segments take the copy-in writes, the reduction's reads and, in two-shot,
        # its result and the copy-out reads.
        if nbytes <= shm.ONESHOT_MAX:
            return Traffic(tensor=2 * nbytes, staging=nbytes + p * nbytes)
        return Traffic(tensor=2 * nbytes, staging=nbytes + (p + 1) / p * nbytes + nbytes)

    def unsupported(self, tensor, op, info):
        return shm.unsupported(info)

    def checks_calls(self, ctx):
        return True  # every piece carries its call's record

    def fast_call(self, tensor, op, ctx):
        return shm.fast_call(ctx.info, self.name, "try_allreduce", tensor, int(op), int(self.mode))

    def run(self, buf, op, ctx):
        if ctx.transport is None:  # the group's shared-memory entry, looked up once per plan
            ctx.transport = shm.state_of(ctx.info)
        shm.all_reduce(buf, ctx.recorded(op), self.mode, ctx.info, self.name, ctx.transport)


ALGORITHM = SharedMemory()
