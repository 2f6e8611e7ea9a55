"""The backend's own reduce-scatter (gloo's on CPU, on the group's commlab connection;
NCCL's on GPU): the baseline."""
import torch.distributed as dist

from commlab.core.reduction import TO_TORCH

from ..base import Cost, by_the_backend, ring_stages
from .base import ReduceScatterAlgorithm


class Builtin(ReduceScatterAlgorithm):
    name = "builtin"
    summary = "the backend's own reduce-scatter: gloo's on CPU (on commlab's connection), NCCL's on GPU"
    formula = "backend-defined; modelled as ring: (p-1)α + (p-1)/p·nβ + (p-1)/p·nγ"
    wins_when = "the reference: NCCL on GPUs"
    order = 0

    def cost(self, p, nbytes):
        return Cost(p - 1, (p - 1) / p * nbytes, (p - 1) / p * nbytes)

    def stages(self, hosts, per_host, nbytes):
        return ring_stages(self.cost(hosts * per_host, nbytes), hosts, self.name)

    def run(self, out, inp, op, ctx):
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = TO_TORCH[op]
        opts.timeout = ctx.info.timeout
        by_the_backend(ctx, self.name, "reduce-scatter", out, inp,
                       lambda backend, o, i: backend._reduce_scatter_base(o, i, opts),
                       lambda: dist.reduce_scatter_tensor(out, inp, op=TO_TORCH[op], group=ctx.info.group,
                                                          async_op=True))


ALGORITHM = Builtin()
