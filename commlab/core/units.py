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


def approx_bytes(n: float) -> str:
    """A size that is not a round multiple, to three figures: 1.31M, 812K."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def parse_rate_gbps(text: str) -> float:
    """A link rate as tc writes it (100mbit, 1gbit, 25gbit, 400gbit) in GB/s (1e9 B)."""
    s = text.strip().lower()
    for unit, bits in (("tbit", 1e12), ("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if s.endswith(unit):
            return float(s[:-len(unit)]) * bits / 8 / 1e9
    raise ValueError(f"not a link rate: {text!r} (examples: 1gbit, 25gbit, 400gbit)")


def parse_duration_us(text: str) -> float:
    s = text.strip().lower()
    for unit, us in (("us", 1.0), ("ms", 1e3), ("ns", 1e-3), ("s", 1e6)):
        if s.endswith(unit):
            return float(s[:-len(unit)]) * us
    raise ValueError(f"not a duration: {text!r} (examples: 5us, 1.5ms)")
