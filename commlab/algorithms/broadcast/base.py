"""The one shape every broadcast algorithm has: `run(buf, root, ctx)` leaves the root's
`buf` (flat, contiguous, any dtype) in every rank's `buf`; `root` is a group rank.
Validation, strided layouts, agreement, async and errors live once, in
commlab/api/broadcast.py."""
from __future__ import annotations

import torch

from ..base import Context, FamilyMember, as_bytes  # noqa: F401 - as_bytes: the family's modules import it from here


class BroadcastAlgorithm(FamilyMember):
    collective = "broadcast"

    @staticmethod
    def busbw_factor(p: int) -> float:
        """nccl-tests' broadcast factor: 1 (the size itself)."""
        return 1.0

    def unsupported(self, buf: torch.Tensor, info) -> str | None:
        """Why this algorithm cannot serve the call, from facts every rank shares."""
        return None


    def run(self, buf: torch.Tensor, root: int, ctx: Context) -> None:
        """buf (n > 0 elements, contiguous) = the root's buf on every rank; ctx.size > 1."""
        raise NotImplementedError


def spans(n: int, parts: int) -> list[tuple[int, int]]:
    """n items cut into `parts` nearly equal spans (the first n % parts one longer)."""
    q, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        size = q + (i < extra)
        out.append((start, start + size))
        start += size
    return out
