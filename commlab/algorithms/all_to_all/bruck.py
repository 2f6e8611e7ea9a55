"""Bruck's all-to-all (Bruck et al. 1997; MPICH's alltoall for small messages):
⌈log2 p⌉ steps instead of p-1. Blocks are first rotated so slot i holds the block for
rank r+i; in step k every block whose slot has bit k set moves 2^k ranks on, packed into
one message; after the last step slot i holds the block from rank r-i. Uneven splits
travel padded to the largest block any rank sends (from the agreed counts)."""
import torch

from ..base import Cost
from .base import AllToAllAlgorithm, as_bytes, split


def _moved(p: int) -> int:
    """Blocks each rank sends over all steps: the slots with bit k set, summed over k."""
    total, d = 0, 1
    while d < p:
        total += sum(1 for i in range(p) if i & d)
        d *= 2
    return total


class Bruck(AllToAllAlgorithm):
    name = "bruck"
    summary = "Bruck: ⌈log2 p⌉ steps, each moving the ~p/2 blocks whose distance has that bit set"
    formula = "⌈log2 p⌉α + ~(⌈log2 p⌉/2)·nβ + 2nβ(local rotations)"
    wins_when = "small messages on many ranks: log2 p steps instead of p-1"
    order = 20

    def cost(self, p, nbytes):
        steps = (p - 1).bit_length() if p > 1 else 0
        return Cost(steps, _moved(p) * nbytes / p, 0.0)

    def run(self, out, inp, counts, ctx):
        p, r = ctx.size, ctx.rank
        width = counts.biggest() * inp.element_size()
        if width == 0:
            return
        send, recv = split(inp, counts.send), split(out, counts.recv)
        slots = torch.empty(p, width, dtype=torch.uint8, device=inp.device)
        for i in range(p):  # slot i: the block for rank r+i
            block = as_bytes(send[(r + i) % p])
            slots[i, :block.numel()].copy_(block)
        d = 1
        while d < p:
            moving = torch.tensor([i for i in range(p) if i & d], device=inp.device)
            packed = slots.index_select(0, moving)
            landed = torch.empty_like(packed)
            ctx.p2p.run([(packed.view(-1), (r + d) % p)], [(landed.view(-1), (r - d) % p)])
            slots.index_copy_(0, moving, landed)
            d *= 2
        for j in range(p):  # slot (r-j) mod p: the block from rank j
            block = as_bytes(recv[j])
            block.copy_(slots[(r - j) % p, :block.numel()])


ALGORITHM = Bruck()
