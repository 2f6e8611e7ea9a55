"""Ring all-gather (MPICH's allgather ring, NCCL's): in step s every rank passes the block
it received in step s-1 to its right neighbour; p-1 steps, each block crosses each link once."""
from commlab.schedule.build import Builder

from ..base import Cost, ring_stages
from .base import AllGatherAlgorithm, blocks, place_own


class Ring(AllGatherAlgorithm):
    name = "ring"
    summary = "ring: p-1 steps, each rank forwards the block it just received"
    formula = "(p-1)α + (p-1)/p·nβ"
    wins_when = "large messages: every link busy, bytes per rank independent of p"
    order = 10

    def cost(self, p, nbytes):
        return Cost(p - 1, (p - 1) / p * nbytes, 0.0)

    def stages(self, hosts, per_host, nbytes):
        return ring_stages(self.cost(hosts * per_host, nbytes), hosts, self.name)

    def run(self, out, inp, ctx):
        p, r = ctx.size, ctx.rank
        b = blocks(out, p)
        place_own(b, inp, r)
        right, left = (r + 1) % p, (r - 1) % p
        for s in range(p - 1):
            ctx.p2p.run([(b[(r - s) % p], right)], [(b[(r - s - 1) % p], left)])

    def schedule(self, p):
        b = Builder("all_gather", p, name="ring")
        for r in range(p):
            b.copy(r, ("i", 0), ("o", r))
        for s in range(p - 1):
            for r in range(p):
                b.send(r, ("o", (r - s) % p), (r + 1) % p, ("o", (r - s) % p))
        return b.build()


ALGORITHM = Ring()
