"""Binomial tree (MPICH's broadcast for short messages): in relative ranks v = r - root,
rank v receives the whole message from v - 2^k (its lowest set bit) and passes it on to
v + 2^j for every smaller j; ⌈log2 p⌉ rounds, the message crossing each round once."""
from commlab.schedule.build import Builder

from ..base import Cost
from .base import BroadcastAlgorithm, as_bytes


class Binomial(BroadcastAlgorithm):
    name = "binomial"
    summary = "binomial tree: ⌈log2 p⌉ rounds, the whole message each round"
    formula = "⌈log2 p⌉α + ⌈log2 p⌉·nβ"
    wins_when = "short messages: fewest rounds"
    order = 10

    def cost(self, p, nbytes):
        steps = (p - 1).bit_length() if p > 1 else 0
        return Cost(steps, steps * nbytes, 0.0)

    def run(self, buf, root, ctx):
        p, r = ctx.size, ctx.rank
        data = as_bytes(buf)
        v = (r - root) % p
        mask = 1
        while mask < p:  # receive once, from the parent that differs in v's lowest set bit
            if v & mask:
                ctx.p2p.run([], [(data, (r - mask) % p)])
                break
            mask <<= 1
        mask >>= 1
        while mask > 0:
            if v + mask < p:
                ctx.p2p.run([(data, (r + mask) % p)], [])
            mask >>= 1

    def schedule(self, p):
        b = Builder("broadcast", p, name="binomial", inplace=True)  # root 0; run() turns the ranks for others
        for v in range(p):
            low = v & -v if v else 1 << (p - 1).bit_length()
            mask = low >> 1
            while mask > 0:
                if v + mask < p:
                    b.send(v, ("i", 0), v + mask, ("i", 0))
                mask >>= 1
        return b.build()


ALGORITHM = Binomial()
