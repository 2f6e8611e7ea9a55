"""What a collective call is, as every rank must agree on it before any of its bytes move
(transports/p2p.py checks it): the record, the codes it is written in, and its readable
forms."""
from __future__ import annotations

import functools
import zlib

import torch

from commlab.core import ext
from commlab.core.collectives import COLLECTIVES, KIND
from commlab.core.reduction import SUPPORTED_DTYPES, Op

# Every dtype a call may name (data movement takes any): the reducible ones first.
_ALL_DTYPES = tuple(SUPPORTED_DTYPES) + tuple(
    d for d in (getattr(torch, n, None) for n in ("bool", "int8", "int16", "uint16", "uint32", "uint64", "complex32",
                                                 "complex64", "complex128", "float8_e4m3fn", "float8_e5m2"))
    if d is not None and d not in SUPPORTED_DTYPES)
_DTYPES = {d: i for i, d in enumerate(_ALL_DTYPES)}

@functools.lru_cache(maxsize=None)  # a few names, asked on every agreed call
def name_code(name: str) -> int:
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


def decode(code: int, names) -> str:
    return next((n for n in names if name_code(n) == code), f"#{code}")


@functools.lru_cache(maxsize=None)  # a few dtypes, asked on every call checked through shared memory
def scalar_code(dtype: torch.dtype) -> int:
    return ext.require().ShmComm.dtype_code(torch.empty(0, dtype=dtype))


def described(row: list[int], algorithms) -> str:
    """One rank's record read from shared memory (ShmComm.records), readable like
    describe()'s; a rank in a shared-memory call shows that call's piece."""
    _, call, kind, total, dtype, op, algorithm, root, index = row
    name = next((n for n, k in KIND.items() if k == kind), f"#{kind}")
    dt = next((str(d).replace("torch.", "") for d in _ALL_DTYPES if scalar_code(d) == dtype), "?")
    if index != -1:
        return f"{name} of {total} bytes of {dt} through shared memory (call {call})"
    how = f" {Op(op).name}" if op >= 0 else ""
    where = f" root {root}" if root >= 0 else ""
    return f"{name} of {total} {dt}{how}{where} by {decode(algorithm, algorithms)} (call {call})"


class CallRecord:
    """What one call is, as every rank must agree on it before any of its bytes move."""

    HEAD = 7  # the columns every rank's record must share; all_to_all's counts follow

    def __init__(self, collective: str, elements: int, dtype: torch.dtype, op: Op | None, algorithm: str,
                 root: int = -1, splits: tuple[list[int], list[int]] | None = None, cuda: bool = False):
        self.collective, self.elements, self.dtype, self.op = collective, elements, dtype, op
        self.algorithm, self.root = algorithm, root
        self.cuda = cuda  # its tensors are on a GPU (how it is checked, not part of the record)
        self.splits = splits  # all_to_all: (elements sent to, received from) each group rank

    def row(self, call: int, p: int) -> list[int]:
        # Every record of a group has one length (2p counts, zeros where there are none): the
        # gather of records can never be the mismatched message.
        send, recv = self.splits if self.splits is not None else ([0] * p, [0] * p)
        return [call, name_code(self.collective), self.elements, _DTYPES.get(self.dtype, -1),
                -1 if self.op is None else int(self.op), self.root, name_code(self.algorithm), *send, *recv]


def describe(row: list[int], algorithms) -> str:
    """One rank's gathered record, readable: '131072 float32 SUM ring (call 3)'."""
    call, collective, elements, dtype, op, root, algorithm = row[:CallRecord.HEAD]
    dt = str(_ALL_DTYPES[dtype]).replace("torch.", "") if 0 <= dtype < len(_ALL_DTYPES) else "?"
    how = f" {Op(op).name}" if op >= 0 else ""
    where = f" root {root}" if root >= 0 else ""
    name = decode(collective, COLLECTIVES)
    size = "" if name == "all_to_all" else f" {elements}"  # its sizes are per peer: checked as a matrix
    return f"{name} of{size} {dt}{how}{where} by {decode(algorithm, algorithms)} (call {call})"


def disagreeing_splits(send: torch.Tensor, recv: torch.Tensor) -> tuple[int, int] | None:
    """The first (sender, receiver), in row order, whose counts differ: send[j, q] elements
    from j to q against the recv[q, j] that q expects; None when they all agree."""
    bad = (send != recv.T).nonzero()
    return None if bad.numel() == 0 else (int(bad[0, 0]), int(bad[0, 1]))
