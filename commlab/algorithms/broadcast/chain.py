"""Pipelined chain (MPICH's and NCCL's ring broadcast for long messages): the ranks form a
line from the root, the message is cut into segments, and each rank forwards segment i
to the next rank as soon as it is in, while later ones arrive; the last rank has it all
after p-2+k segment times, every link carrying the message once."""
import os

from ..base import Cost
from .base import BroadcastAlgorithm, as_bytes, spans

SEGMENT = int(os.environ.get("COMMLAB_CHAIN_SEGMENT", str(256 << 10)))  # bytes per pipelined piece


class Chain(BroadcastAlgorithm):
    name = "chain"
    summary = "pipelined chain from the root: segments forwarded while the next arrives"
    formula = "(p-2+k)α + (1 + (p-2)/k)·nβ, k = ⌈n / segment⌉"
    wins_when = "long messages on few links: every link busy at once"
    order = 30

    def cost(self, p, nbytes):
        if p <= 1:
            return Cost(0, 0.0, 0.0)
        k = max(1, -(-int(nbytes) // SEGMENT))
        return Cost(p - 2 + k, (1 + (p - 2) / k) * nbytes, 0.0)

    def run(self, buf, root, ctx):
        p, r = ctx.size, ctx.rank
        data = as_bytes(buf)
        n = data.numel()
        segs = [data[a:b] for a, b in spans(n, max(1, -(-n // SEGMENT)))]
        v = (r - root) % p
        prev, nxt = (r - 1) % p, (r + 1) % p
        last = v == p - 1
        if v == 0:  # every segment posted at once: the next rank paces them
            ctx.p2p.run([(s, nxt) for s in segs], [])
            return
        # Every receive posted at once; each segment is passed on as soon as it is in.
        incoming = ctx.p2p.post([], [(s, prev) for s in segs])
        outgoing = []
        for i, s in enumerate(segs):
            incoming.wait_recv(i)
            if not last:
                outgoing.append(ctx.p2p.post([(s, nxt)], []))
        for step in outgoing:
            step.wait_all()

ALGORITHM = Chain()
