"""The backend's own broadcast (gloo's on CPU, on the group's commlab connection; NCCL's
on GPU): the baseline."""
import torch.distributed as dist

from commlab.core.errors import PeerError
from commlab.transports.p2p import moves_cuda

from ..base import Cost
from .base import BroadcastAlgorithm, as_bytes


class Builtin(BroadcastAlgorithm):
    name = "builtin"
    summary = "the backend's own broadcast: gloo's on CPU (on commlab's connection), NCCL's on GPU"
    formula = "backend-defined; modelled as binomial: ⌈log2 p⌉α + ⌈log2 p⌉·nβ"
    wins_when = "the reference: NCCL on GPUs"
    order = 0

    def cost(self, p, nbytes):
        steps = (p - 1).bit_length() if p > 1 else 0
        return Cost(steps, steps * nbytes, 0.0)

    def run(self, buf, root, ctx):
        if buf.is_cpu or not moves_cuda(ctx.info.group):
            # GPU tensors of a gloo group go through a host copy: gloo's broadcast takes host memory.
            host = buf if buf.is_cpu else buf.cpu()
            opts = dist.BroadcastOptions()
            opts.rootRank, opts.rootTensor = root, 0
            opts.timeout = ctx.info.timeout
            data = as_bytes(host)  # gloo refuses complex; bytes are bytes
            ctx.p2p.collective(lambda backend: backend.broadcast([data], opts), "gloo's broadcast")
            if host is not buf:
                buf.copy_(host)
            return
        try:
            work = dist.broadcast(buf, src=ctx.info.global_rank(root), group=ctx.info.group, async_op=True)
            work.wait(ctx.info.timeout)
        except RuntimeError as e:
            raise PeerError(f"commlab[{self.name}] rank {ctx.info.global_rank(ctx.rank)}: backend broadcast failed: {e}",
                            algorithm=self.name, peer=None) from e


ALGORITHM = Builtin()
