"""The backend's own all-to-all (gloo's on CPU, on the group's commlab connection; NCCL's
on GPU): the baseline."""
import torch.distributed as dist

from ..base import Cost, by_the_backend
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
        size = out.element_size()
        recv, send = [c * size for c in counts.recv], [c * size for c in counts.send]
        opts = dist.AllToAllOptions()
        opts.timeout = ctx.info.timeout
        # gloo refuses complex; bytes are bytes
        by_the_backend(ctx, self.name, "all-to-all", out, inp,
                       lambda backend, o, i: backend.alltoall_base(as_bytes(o), as_bytes(i), recv, send, opts),
                       lambda: dist.all_to_all_single(out, inp, counts.recv, counts.send, group=ctx.info.group,
                                                      async_op=True))


ALGORITHM = Builtin()
