"""Sizes as nccl-tests writes them: 4K, 1M, 1G are binary multiples."""
from __future__ import annotations

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def parse_bytes(text) -> int:
    s = str(text).strip().upper()
    i = len(s)
    while i and not s[i - 1].isdigit():
        i -= 1
    num, unit = s[:i], s[i:].strip()
    if not num or unit not in _UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 8, 4K, 1M, 1G)")
    return int(float(num) * _UNITS[unit])


def format_bytes(n: float) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{int(n // scale)}{unit}"
    return f"{int(n)}"
