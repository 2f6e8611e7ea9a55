"""The backend's own broadcast (gloo's on CPU, on the group's commlab connection; NCCL's
on GPU): the baseline."""
import torch.distributed as dist

from ..base import Cost, by_the_backend
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
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = root, 0
        opts.timeout = ctx.info.timeout
        # gloo refuses complex; bytes are bytes
        by_the_backend(ctx, self.name, "broadcast", buf, None,
                       lambda backend, b, _: backend.broadcast([as_bytes(b)], opts),
                       lambda: dist.broadcast(buf, src=ctx.info.global_rank(root), group=ctx.info.group, async_op=True))


ALGORITHM = Builtin()
