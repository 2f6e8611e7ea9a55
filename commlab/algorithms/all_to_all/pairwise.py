"""Pairwise exchange (MPICH's alltoall for large messages, Thakur-Rabenseifner-Gropp): p-1
steps; in step s rank r sends its block for r+s and receives from r-s (partner r xor s
when p is a power of two, so each step pairs ranks both ways). Any splits: each block
moves once, directly."""
from commlab.schedule.build import Builder

from ..base import Cost
from .base import AllToAllAlgorithm, as_bytes, split


class Pairwise(AllToAllAlgorithm):
    name = "pairwise"
    summary = "pairwise exchange: p-1 steps, one block to one peer and one from another per step"
    formula = "(p-1)α + (p-1)/p·nβ (n: each rank's input)"
    wins_when = "large messages: every byte moves once, one peer per step"
    order = 10

    def cost(self, p, nbytes):
        return Cost(p - 1, (p - 1) / p * nbytes, 0.0)

    def run(self, out, inp, counts, ctx):
        p, r = ctx.size, ctx.rank
        send, recv = split(inp, counts.send), split(out, counts.recv)
        recv[r].copy_(send[r])
        pow2 = p & (p - 1) == 0
        for s in range(1, p):
            to, frm = (r ^ s, r ^ s) if pow2 else ((r + s) % p, (r - s) % p)
            ctx.p2p.run([(as_bytes(send[to]), to)], [(as_bytes(recv[frm]), frm)])

    def schedule(self, p):
        b = Builder("all_to_all", p, name="pairwise")
        pow2 = p & (p - 1) == 0
        for r in range(p):
            b.copy(r, ("i", r), ("o", r))
        for s in range(1, p):
            for r in range(p):
                to = r ^ s if pow2 else (r + s) % p
                b.send(r, ("i", to), to, ("o", r))
        return b.build()


ALGORITHM = Pairwise()
