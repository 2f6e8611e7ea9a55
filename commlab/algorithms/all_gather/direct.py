"""Direct: every rank sends its block to every other rank in one step (p-1 sends and
receives posted at once; MPICH's allgather for few ranks, NCCL's for NVLink-connected GPUs)."""
from commlab.schedule.build import Builder

from ..base import Cost
from .base import AllGatherAlgorithm, blocks, place_own


class Direct(AllGatherAlgorithm):
    name = "direct"
    summary = "one step: every rank sends its block to every other rank at once"
    formula = "(p-1)α + (p-1)/p·nβ (one step, p-1 messages in flight)"
    wins_when = "few ranks with full-bisection links: one round trip"
    order = 30

    def cost(self, p, nbytes):
        return Cost(p - 1, (p - 1) / p * nbytes, 0.0)

    def run(self, out, inp, ctx):
        p, r = ctx.size, ctx.rank
        b = blocks(out, p)
        place_own(b, inp, r)
        peers = [(r + k) % p for k in range(1, p)]  # staggered: rank r's first message goes to r+1, not to 0
        ctx.p2p.run([(b[r], q) for q in peers], [(b[q], q) for q in peers])

    def schedule(self, p):
        b = Builder("all_gather", p, name="direct")
        for r in range(p):
            b.copy(r, ("i", 0), ("o", r))
            for k in range(1, p):
                b.send(r, ("i", 0), (r + k) % p, ("o", r))
        return b.build()


ALGORITHM = Direct()
