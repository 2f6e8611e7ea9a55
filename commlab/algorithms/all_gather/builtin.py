"""The backend's own all-gather (gloo's on CPU, on the group's commlab connection; NCCL's
on GPU): the baseline."""
import torch.distributed as dist

from ..base import Cost, by_the_backend, ring_stages
from .base import AllGatherAlgorithm, as_bytes


class Builtin(AllGatherAlgorithm):
    name = "builtin"
    summary = "the backend's own all-gather: gloo's on CPU (on commlab's connection), NCCL's on GPU"
    formula = "backend-defined; modelled as ring: (p-1)α + (p-1)/p·nβ"
    wins_when = "the reference: NCCL on GPUs"
    order = 0

    def cost(self, p, nbytes):
        return Cost(p - 1, (p - 1) / p * nbytes, 0.0)

    def stages(self, hosts, per_host, nbytes):
        return ring_stages(self.cost(hosts * per_host, nbytes), hosts, self.name)

    def run(self, out, inp, ctx):
        opts = dist.distributed_c10d.AllgatherOptions()
        opts.timeout = ctx.info.timeout
        # gloo refuses complex; bytes are bytes
        by_the_backend(ctx, self.name, "all-gather", out, inp,
                       lambda backend, o, i: backend._allgather_base(as_bytes(o), as_bytes(i), opts),
                       lambda: dist.all_gather_into_tensor(out, inp, group=ctx.info.group, async_op=True))


ALGORITHM = Builtin()
