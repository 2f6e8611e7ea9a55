"""Bandwidth-optimal ring: reduce-scatter then all-gather (Patarasuk & Yuan; gloo's
allreduce_ring_chunked). Each rank sends 2(p-1)/p·n bytes in 2(p-1) steps."""
import os

import torch

from commlab.core import chunks
from commlab.core.reduction import combine_
from commlab.schedule.build import Builder

from ..base import Algorithm, Cost, ring_stages

# Within one step a chunk travels as segments so the reduction of segment k
# overlaps the transfer of segment k+1.
SEGMENT_BYTES = int(os.environ.get("COMMLAB_RING_SEGMENT_BYTES", str(1 << 20)))


class Ring(Algorithm):
    name = "ring"
    summary = "ring reduce-scatter + all-gather, segmented so transfers overlap reductions"
    formula = "2(p-1)α + 2(p-1)/p·nβ + (p-1)/p·nγ"
    wins_when = "large messages: every link busy, bytes per rank independent of p"
    order = 10

    def cost(self, p, nbytes):
        return Cost(2 * (p - 1), 2 * (p - 1) / p * nbytes, (p - 1) / p * nbytes)

    def stages(self, hosts, per_host, nbytes):
        return ring_stages(self.cost(hosts * per_host, nbytes), hosts, self.name)


    def run(self, buf, op, ctx):
        p, r = ctx.size, ctx.rank
        right, left = (r + 1) % p, (r - 1) % p
        parts = chunks.views(buf, p)
        seg = max(1, SEGMENT_BYTES // buf.element_size())
        scratch = torch.empty(parts[0].numel(), dtype=buf.dtype, device=buf.device)

        # Reduce-scatter: after step s, chunk (r-s-1) holds s+2 ranks' contributions;
        # after p-1 steps rank r owns the full reduction of chunk (r+1) mod p.
        for s in range(p - 1):
            outgoing = parts[(r - s) % p]
            target = parts[(r - s - 1) % p]
            incoming = scratch[: target.numel()]
            in_segs = chunks.segments(incoming, seg)
            step = ctx.p2p.post(
                [(x, right) for x in chunks.segments(outgoing, seg)],
                [(x, left) for x in in_segs],
            )
            for j, (got, mine) in enumerate(zip(in_segs, chunks.segments(target, seg))):
                step.wait_recv(j)
                combine_(mine, got, op)
            step.wait_all()

        # All-gather: each reduced chunk travels once around the ring; every rank
        # ends with the owner's bytes, so results are bitwise identical.
        for s in range(p - 1):
            ctx.p2p.run([(parts[(r + 1 - s) % p], right)], [(parts[(r - s) % p], left)])

    def schedule(self, p):
        b = Builder("all_reduce", p, per_rank=p, name="ring", inplace=True)
        for s in range(p - 1):  # the reduce-scatter: chunk r - s travels right, folded at every rank
            for r in range(p):
                b.send(r, ("i", (r - s) % p), (r + 1) % p, ("i", (r - s) % p), reduce=True)
        for s in range(p - 1):  # the all-gather: rank r owns chunk r + 1 and passes it on
            for r in range(p):
                b.send(r, ("i", (r + 1 - s) % p), (r + 1) % p, ("i", (r + 1 - s) % p))
        return b.build()


ALGORITHM = Ring()
