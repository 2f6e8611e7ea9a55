"""Direct exchange: every rank sends its whole tensor to every other rank, then reduces
all p inputs in rank order. One step, the fewest possible, for (p-1)·n bytes per rank:
the latency-bound extreme that recursive doubling trades log2(p) steps against."""
import torch

from commlab.core.reduction import reduce_into

from ..base import Algorithm, Cost


class Direct(Algorithm):
    name = "direct"
    summary = "one step: every rank sends its tensor to every other, then reduces all p in rank order"
    formula = "α + (p-1)·nβ + (p-1)·nγ"
    wins_when = "tiny messages on a full-bisection network, where one step beats log2(p)"
    order = 45

    def cost(self, p, nbytes):
        return Cost(1, (p - 1) * nbytes, (p - 1) * nbytes)

    def run(self, buf, op, ctx):
        inputs = [buf if q == ctx.rank else torch.empty_like(buf) for q in range(ctx.size)]
        peers = [q for q in range(ctx.size) if q != ctx.rank]
        ctx.p2p.run([(buf, q) for q in peers], [(inputs[q], q) for q in peers])
        # The same inputs in the same order on every rank: identical bits everywhere.
        reduce_into(buf, inputs, op)


ALGORITHM = Direct()
