"""Element-wise reduction semantics shared by every algorithm.

Algorithms only ever see SUM, PRODUCT, MIN and MAX. AVG is SUM followed by one
division by the group size, done once by the API after the algorithm, so every
algorithm averages the same way (integers truncate toward zero, as NCCL does).
"""
from __future__ import annotations

import enum

import torch
import torch.distributed as dist

from commlab.core import ext
from commlab.core.errors import UnsupportedError


class Op(enum.IntEnum):
    """csrc/common/codes.h's RedOp, plus AVG (never passed to _C)."""

    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    AVG = 4


_FROM_TORCH = {
    dist.ReduceOp.SUM: Op.SUM,
    dist.ReduceOp.PRODUCT: Op.PRODUCT,
    dist.ReduceOp.MIN: Op.MIN,
    dist.ReduceOp.MAX: Op.MAX,
    dist.ReduceOp.AVG: Op.AVG,
}

TO_TORCH = {v: k for k, v in _FROM_TORCH.items()}

SUPPORTED_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int32,
    torch.int64,
    torch.uint8,
)

HALF_TYPES = (torch.float16, torch.bfloat16)


def parse_op(op) -> Op:
    if isinstance(op, Op):
        return op
    try:
        return _FROM_TORCH[op]  # the common case: a dist.ReduceOp member
    except (KeyError, TypeError):
        pass
    if isinstance(op, str):
        try:
            return Op[op.upper()]
        except KeyError:
            pass
    else:
        for torch_op, ours in _FROM_TORCH.items():
            try:
                if op == torch_op:
                    return ours
            except TypeError:
                continue
    raise UnsupportedError(
        f"commlab: reduction op {op!r} is not supported (supported: SUM, AVG, PRODUCT, MIN, MAX)"
    )


_BINARY = {Op.SUM: torch.add, Op.PRODUCT: torch.mul, Op.MIN: torch.minimum, Op.MAX: torch.maximum}


def combine_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, op: Op) -> torch.Tensor:
    """out = a (op) b with a as the left operand; out may be a or b. One rounding for
    16-bit floats (torch computes their element-wise ops in float32). Keeping the
    operand order fixed matters where IEEE results are not symmetric (NaN payloads)."""
    try:
        fn = _BINARY[op]
    except KeyError:
        raise AssertionError(f"combine_into got {op!r}; AVG is resolved by the API") from None
    return fn(a, b, out=out)


def combine_(acc: torch.Tensor, other: torch.Tensor, op: Op) -> torch.Tensor:
    """acc = acc (op) other, in place."""
    return combine_into(acc, acc, other, op)


def reduce_into(out: torch.Tensor, inputs: list[torch.Tensor], op: Op) -> torch.Tensor:
    """out = inputs[0] op inputs[1] op ... in list order, each input read once;
    16-bit floats accumulate in float32 and round once. `out` may be any of the inputs:
    every kernel reads all inputs of an element (or block) before writing it."""

    if ext.reduce_n_serves(out):
        ext.C.reduce_n(out, inputs, int(op))
        return out
    # Fallback for devices the extension was not compiled for.
    if out.dtype in HALF_TYPES:
        acc = inputs[0].to(torch.float32)
        for x in inputs[1:]:
            combine_(acc, x.to(torch.float32), op)
        return out.copy_(acc)
    acc = inputs[0].clone()
    for x in inputs[1:]:
        combine_(acc, x, op)
    return out.copy_(acc)


def finish_average_(t: torch.Tensor, n: int) -> torch.Tensor:
    if n == 1:
        return t
    if t.is_floating_point():
        return t.div_(n)
    return t.copy_(torch.div(t, n, rounding_mode="trunc"))
