"""The backend's own all-reduce (gloo's on CPU, NCCL's on GPU): the baseline. On CPU it
runs on the group's own gloo connection (transports/link.py): the same algorithm as
the group's gloo, but a peer that gives up fails it at once, not at the timeout."""
import torch.distributed as dist

from commlab.core.reduction import TO_TORCH

from ..base import Algorithm, Cost, by_the_backend, ring_stages


class Builtin(Algorithm):
    name = "builtin"
    summary = "the backend's own all-reduce: gloo's ring on CPU (on commlab's connection), NCCL's ring/tree on GPU"
    formula = "backend-defined; modelled as ring: 2(p-1)α + 2(p-1)/p·nβ + (p-1)/p·nγ"
    wins_when = "the reference: NCCL on GPUs; gloo's fixed cost makes it slow for small CPU messages"
    order = 0

    def cost(self, p, nbytes):
        return Cost(2 * (p - 1), 2 * (p - 1) / p * nbytes, (p - 1) / p * nbytes)

    def stages(self, hosts, per_host, nbytes):
        return ring_stages(self.cost(hosts * per_host, nbytes), hosts, self.name)  # gloo's allreduce is a ring

    def run(self, buf, op, ctx):
        opts = dist.AllreduceOptions()
        opts.reduceOp = TO_TORCH[op]
        opts.timeout = ctx.info.timeout
        by_the_backend(ctx, self.name, "all-reduce", buf, None, lambda backend, b, _: backend.allreduce([b], opts),
                       lambda: dist.all_reduce(buf, op=TO_TORCH[op], group=ctx.info.group, async_op=True))


ALGORITHM = Builtin()
