"""The backend's own all-gather (gloo's on CPU, on the group's commlab connection; NCCL's
on GPU): the baseline."""
import torch
import torch.distributed as dist

from commlab.core.errors import PeerError
from commlab.transports.p2p import moves_cuda

from ..base import Cost, ring_stages
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
        if out.is_cpu or not moves_cuda(ctx.info.group):
            # GPU tensors of a gloo group go through host copies: gloo's all-gather takes host memory.
            host_out = out if out.is_cpu else torch.empty(out.shape, dtype=out.dtype)
            host_inp = inp if inp.is_cpu else inp.cpu()
            opts = dist.distributed_c10d.AllgatherOptions()
            opts.timeout = ctx.info.timeout
            o, i = as_bytes(host_out), as_bytes(host_inp)  # gloo refuses complex; bytes are bytes
            ctx.p2p.collective(lambda backend: backend._allgather_base(o, i, opts), "gloo's all-gather")
            if host_out is not out:
                out.copy_(host_out)
            return
        try:
            work = dist.all_gather_into_tensor(out, inp, group=ctx.info.group, async_op=True)
            work.wait(ctx.info.timeout)
        except RuntimeError as e:
            raise PeerError(f"commlab[{self.name}] rank {ctx.info.global_rank(ctx.rank)}: backend all_gather failed: {e}",
                            algorithm=self.name, peer=None) from e


ALGORITHM = Builtin()
