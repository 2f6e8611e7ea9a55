"""Ring reduce-scatter (the first half of the ring all-reduce; NCCL's, MPICH's for large
messages): in step s rank r passes its running reduction of block r-s-1 to its right
neighbour and folds its own copy of block r-s-2 into what arrives from the left; after
p-1 steps it holds block r reduced over every rank."""
import torch

from commlab.core.reduction import combine_into
from commlab.schedule.build import Builder

from ..base import Cost, ring_stages
from .base import ReduceScatterAlgorithm, slices


class Ring(ReduceScatterAlgorithm):
    name = "ring"
    summary = "ring: p-1 steps, each rank folds what arrives into its own block and passes it on"
    formula = "(p-1)α + (p-1)/p·nβ + (p-1)/p·nγ"
    wins_when = "large messages: every link busy, bytes per rank independent of p"
    order = 10

    def cost(self, p, nbytes):
        return Cost(p - 1, (p - 1) / p * nbytes, (p - 1) / p * nbytes)

    def stages(self, hosts, per_host, nbytes):
        return ring_stages(self.cost(hosts * per_host, nbytes), hosts, self.name)

    def run(self, out, inp, op, ctx):
        p, r = ctx.size, ctx.rank
        b = slices(inp, p)
        right, left = (r + 1) % p, (r - 1) % p
        landing, spare = torch.empty_like(out), torch.empty_like(out)
        sending = b[(r - 1) % p]  # the first step sends the input's own block: nothing reduced yet
        for s in range(p - 1):
            ctx.p2p.run([(sending, right)], [(landing, left)])  # returns once both are done
            # What arrived, folded with this rank's copy: sent on next step, or the result.
            sending = out if s == p - 2 else spare
            combine_into(sending, landing, b[(r - s - 2) % p], op)
    def schedule(self, p):
        b = Builder("reduce_scatter", p, name="ring")
        for s in range(p - 1):  # what arrives, folded with the receiver's copy: passed on, or the result
            for r in range(p):
                to = (r + 1) % p
                src = ("i", (r - 1) % p) if s == 0 else ("s", (s - 1) % 2)
                dst = ("o", 0) if s == p - 2 else ("s", s % 2)
                b.send(r, src, to, dst, fold_with=("i", (to - s - 2) % p))
        return b.build()


ALGORITHM = Ring()
