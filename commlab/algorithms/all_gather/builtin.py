"""The backend's own all-gather (gloo's on CPU, on the group's commlab connection; NCCL's
on GPU): the baseline."""
import torch.distributed as dist

from commlab.core.errors import PeerError

from ..base import Cost
from ..ring import ring_stages
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
        if out.is_cpu:
            opts = dist.distributed_c10d.AllgatherOptions()
            opts.timeout = ctx.info.timeout
            o, i = as_bytes(out), as_bytes(inp)  # gloo refuses complex; bytes are bytes
            ctx.p2p.collective(lambda backend: backend._allgather_base(o, i, opts), "gloo's all-gather")
            return
        try:
            work = dist.all_gather_into_tensor(out, inp, group=ctx.info.group, async_op=True)
            work.wait(ctx.info.timeout)
        except RuntimeError as e:
            raise PeerError(f"commlab[{self.name}] rank {ctx.info.global_rank(ctx.rank)}: backend all_gather failed: {e}",
                            algorithm=self.name, peer=None) from e


ALGORITHM = Builtin()
