"""The backend's own all-to-all (gloo's on CPU, on the group's commlab connection; NCCL's
on GPU): the baseline."""
import torch
import torch.distributed as dist

from commlab.core.errors import PeerError
from commlab.transports.p2p import moves_cuda

from ..base import Cost
from .base import AllToAllAlgorithm, as_bytes


class Builtin(AllToAllAlgorithm):
    name = "builtin"
    summary = "the backend's own all-to-all: gloo's on CPU (on commlab's connection), NCCL's on GPU"
    formula = "backend-defined; modelled as pairwise: (p-1)α + (p-1)/p·nβ"
    wins_when = "the reference: NCCL on GPUs"
    order = 0

    def cost(self, p, nbytes):
        return Cost(p - 1, (p - 1) / p * nbytes, 0.0)

    def run(self, out, inp, counts, ctx):
        if out.is_cpu or not moves_cuda(ctx.info.group):
            # GPU tensors of a gloo group go through host copies: gloo's all-to-all takes host memory.
            host_out = out if out.is_cpu else torch.empty(out.shape, dtype=out.dtype)
            host_inp = inp if inp.is_cpu else inp.cpu()
            size = out.element_size()
            o, i = as_bytes(host_out), as_bytes(host_inp)  # gloo refuses complex; bytes are bytes
            recv, send = [c * size for c in counts.recv], [c * size for c in counts.send]
            opts = dist.AllToAllOptions()
            opts.timeout = ctx.info.timeout
            ctx.p2p.collective(lambda backend: backend.alltoall_base(o, i, recv, send, opts), "gloo's all-to-all")
            if host_out is not out:
                out.copy_(host_out)
            return
        try:
            work = dist.all_to_all_single(out, inp, counts.recv, counts.send, group=ctx.info.group, async_op=True)
            work.wait(ctx.info.timeout)
        except RuntimeError as e:
            raise PeerError(f"commlab[{self.name}] rank {ctx.info.global_rank(ctx.rank)}: backend all_to_all failed: {e}",
                            algorithm=self.name, peer=None) from e


ALGORITHM = Builtin()
