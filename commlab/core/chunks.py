"""Splitting a flat buffer into p near-equal parts; every rank computes the same split."""
from __future__ import annotations

import torch


def bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """[start, end) of each part; the first numel % parts parts get one extra element,
    so any numel works, including 0 and numel < parts (trailing parts are empty)."""
    base, extra = divmod(numel, parts)
    out, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


def views(flat: torch.Tensor, parts: int) -> list[torch.Tensor]:
    return [flat[s:e] for s, e in bounds(flat.numel(), parts)]


def segments(t: torch.Tensor, max_elems: int) -> list[torch.Tensor]:
    """Pipelining segments of at most max_elems elements (one segment when empty)."""
    n = t.numel()
    if n <= max_elems:
        return [t]
    return [t[s : s + max_elems] for s in range(0, n, max_elems)]
