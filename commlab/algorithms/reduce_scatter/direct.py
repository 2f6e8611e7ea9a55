"""Direct: every rank sends block q of its input to rank q in one step and reduces the p
copies of its own block in rank order (MPICH's pairwise reduce-scatter, all messages in
flight at once)."""
import torch

from commlab.core.reduction import reduce_into
from commlab.schedule.build import Builder

from ..base import Cost
from .base import ReduceScatterAlgorithm, slices


class Direct(ReduceScatterAlgorithm):
    name = "direct"
    summary = "one step: every rank sends each peer its block, then reduces the p copies of its own"
    formula = "(p-1)α + (p-1)/p·nβ + (p-1)/p·nγ (one step, p-1 messages in flight)"
    wins_when = "few ranks with full-bisection links: one round trip"
    order = 30

    def cost(self, p, nbytes):
        return Cost(p - 1, (p - 1) / p * nbytes, (p - 1) / p * nbytes)

    def run(self, out, inp, op, ctx):
        p, r = ctx.size, ctx.rank
        b = slices(inp, p)
        got = torch.empty(p, out.numel(), dtype=out.dtype, device=out.device)
        peers = [(r + k) % p for k in range(1, p)]  # staggered: rank r's first message goes to r+1
        ctx.p2p.run([(b[q], q) for q in peers], [(got[q], q) for q in peers])
        got[r].copy_(b[r])
        reduce_into(out, list(got.unbind(0)), op)  # rank order: the same fold whatever arrived first

    def schedule(self, p):
        b = Builder("reduce_scatter", p, name="direct")
        for r in range(p):
            for k in range(1, p):
                b.send(r, ("i", (r + k) % p), (r + k) % p, ("s", r))
        for r in range(p):  # rank order, as run() folds: block q from s[q], its own from the input
            own = [("i", r) if q == r else ("s", q) for q in range(p)]
            b.copy(r, own[0], ("o", 0))
            for ref in own[1:]:
                b.reduce(r, ref, ("o", 0))
        return b.build()


ALGORITHM = Direct()
