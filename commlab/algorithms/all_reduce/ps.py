"""Central parameter server, DataParallel's pattern: every worker sends its whole
tensor to the root, the root reduces in rank order and sends the result back.
The root moves 2(p-1)·n bytes and holds p copies: the bottleneck the seed measures."""
import torch

from commlab.core.reduction import reduce_into

from ..base import Algorithm, Cost

ROOT = 0


class ParameterServer(Algorithm):
    name = "ps"
    summary = "central parameter server on group rank 0 (DataParallel-style gather, reduce, broadcast)"
    formula = "2(p-1)α + 2(p-1)·nβ + (p-1)·nγ  (all of it on the root)"
    wins_when = "almost never for all-reduce; it shows why a central server does not scale"
    order = 20

    def cost(self, p, nbytes):
        return Cost(2 * (p - 1), 2 * (p - 1) * nbytes, (p - 1) * nbytes)

    def run(self, buf, op, ctx):
        p, r = ctx.size, ctx.rank
        if r != ROOT:
            ctx.p2p.run([(buf, ROOT)], [])
            ctx.p2p.run([], [(buf, ROOT)])
            return
        inputs = [buf] + [torch.empty_like(buf) for _ in range(p - 1)]
        ctx.p2p.run([], [(inputs[k], k) for k in range(1, p)])
        # One fused pass in fixed rank order: 16-bit floats accumulate in float32.
        reduce_into(buf, inputs, op)
        del inputs[1:]
        ctx.p2p.run([(buf, k) for k in range(1, p)], [])


ALGORITHM = ParameterServer()
