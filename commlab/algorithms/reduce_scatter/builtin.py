"""The backend's own reduce-scatter (gloo's on CPU, on the group's commlab connection;
NCCL's on GPU): the baseline."""
import torch
import torch.distributed as dist

from commlab.core.errors import PeerError
from commlab.core.reduction import TO_TORCH
from commlab.transports.p2p import moves_cuda

from ..base import Cost, ring_stages
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
        if out.is_cpu or not moves_cuda(ctx.info.group):
            # GPU tensors of a gloo group go through host copies: gloo's reduce-scatter takes host memory.
            host_out = out if out.is_cpu else torch.empty(out.shape, dtype=out.dtype)
            host_inp = inp if inp.is_cpu else inp.cpu()
            opts = dist.ReduceScatterOptions()
            opts.reduceOp = TO_TORCH[op]
            opts.timeout = ctx.info.timeout
            ctx.p2p.collective(lambda backend: backend._reduce_scatter_base(host_out, host_inp, opts),
                               "gloo's reduce-scatter")
            if host_out is not out:
                out.copy_(host_out)
            return
        try:
            work = dist.reduce_scatter_tensor(out, inp, op=TO_TORCH[op], group=ctx.info.group, async_op=True)
            work.wait(ctx.info.timeout)
        except RuntimeError as e:
            raise PeerError(
                f"commlab[{self.name}] rank {ctx.info.global_rank(ctx.rank)}: backend reduce_scatter failed: {e}",
                algorithm=self.name, peer=None) from e


ALGORITHM = Builtin()
