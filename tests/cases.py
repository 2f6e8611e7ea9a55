"""Deterministic inputs and float64 references for all-reduce correctness checks.

Every rank can build every rank's input from (seed, rank), so each rank checks its
own result against an exact reference without extra communication.
"""
from __future__ import annotations

import contextlib
import hashlib
import zlib

import torch

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8]
# What the families that move bytes without reducing them (all-gather, all-to-all, broadcast) carry.
MOVED_DTYPES = DTYPES + [torch.int8, torch.bool, torch.complex64]
OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX"]

EPS = {
    torch.float32: 2.0**-24,
    torch.float64: 2.0**-53,
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
}


def seeded(key: str, shape, dtype: torch.dtype) -> torch.Tensor:
    """Values in [-100, 100) of any dtype, the same on every rank for the same key: what
    the families that move bytes send (bools, unsigned and complex included)."""
    g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    x = torch.randint(-100, 100, shape if isinstance(shape, tuple) else (shape,), generator=g, dtype=torch.int64)
    if dtype == torch.bool:
        return x > 0
    if dtype == torch.uint8:
        return (x + 100).to(dtype)
    if dtype.is_complex:
        return torch.complex(x.float(), -x.float()).to(dtype)
    return x.to(dtype)


def make_input(seed: int, rank: int, numel: int, dtype: torch.dtype, op: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    if dtype.is_floating_point:
        if op == "PRODUCT":
            x = torch.rand(numel, generator=g, dtype=torch.float64) + 0.5
        else:
            x = torch.randn(numel, generator=g, dtype=torch.float64) * 4
        return x.to(dtype)
    lo, hi = (1, 4) if op == "PRODUCT" else ((0, 30) if dtype == torch.uint8 else (-50, 50))
    return torch.randint(lo, hi, (numel,), generator=g, dtype=torch.int64).to(dtype)


def reference(inputs: list[torch.Tensor], op: str, dtype: torch.dtype):
    """(expected, tolerance): tolerance is None for exact comparison."""
    p = len(inputs)
    wide = torch.stack([x.to(torch.float64 if dtype.is_floating_point else torch.int64) for x in inputs])
    if op in ("MIN", "MAX"):
        red = wide.amin(0) if op == "MIN" else wide.amax(0)
        return red.to(dtype), None
    if not dtype.is_floating_point:
        if op == "PRODUCT":
            red = wide.prod(0)
        else:
            red = wide.sum(0)
        # Integer arithmetic wraps in the dtype, so compare after the same wrap.
        red = red.to(dtype)
        if op == "AVG":
            red = torch.div(red.to(torch.int64), p, rounding_mode="trunc").to(dtype)
        return red, None
    eps = EPS[dtype]
    if op == "PRODUCT":
        red = wide.prod(0)
        tol = (p + 2) * eps * red.abs() * 1.5
    else:
        red = wide.sum(0)
        # Any summation order: |error| <= (p-1)·eps·Σ|x| plus the final rounding(s).
        tol = (p + 2) * eps * wide.abs().sum(0)
        if op == "AVG":
            red, tol = red / p, tol / p + eps * (red / p).abs()
    return red, tol + 1e-300


def check(result: torch.Tensor, expected: torch.Tensor, tol) -> str | None:
    if result.dtype != expected.dtype and tol is None:
        return f"dtype {result.dtype} != {expected.dtype}"
    if tol is None:
        if torch.equal(result, expected):
            return None
        bad = (result != expected).nonzero()
        i = int(bad[0])
        return f"{len(bad)} wrong; first at {i}: got {result[i].item()} want {expected[i].item()}"
    err = (result.to(torch.float64) - expected).abs()
    bad = (err > tol) | torch.isnan(err)
    if not bool(bad.any()):
        return None
    i = int(bad.nonzero()[0])
    return f"{int(bad.sum())} out of tolerance; first at {i}: got {result[i].item()} want {expected[i].item()} (tol {tol[i].item():.3g})"


def digest(t: torch.Tensor) -> str:
    t = t.detach().contiguous().cpu()
    return hashlib.sha1(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()


# Emulated host layouts (COMMLAB_HOST_ID splits one machine's ranks into hosts; shared
# memory then serves each host's ranks only): world size -> host of each rank.
HOST_LAYOUTS = {
    "2x2": (4, [0, 0, 1, 1]),
    "interleaved 2x2": (4, [0, 1, 0, 1]),
    "3+1": (4, [0, 0, 0, 1]),
    "2+1": (3, [1, 0, 0]),
    "1x3": (3, [0, 1, 2]),
    "1 host": (3, [0, 0, 0]),
}


# -- what every family's failure tests share ----------------------------------------------

def first_two_quick(*cases):
    """Fault cases: the first two in the quick tier, the rest marked slow."""
    import pytest

    return [c if i < 2 else pytest.param(*c, marks=pytest.mark.slow) for i, c in enumerate(cases)]


# Seconds of calls before a drill's fault: dozens of calls past the set-up are in flight by
# then; the CLI's 0.5 s adds nothing a test reads, and there are seventy drills.
DRILL_DELAY = 0.2


def assert_drill_named_rank_1(algorithm: str, fault: str, collective: str) -> None:
    """Rank 1 of 3 fails (killed, interrupted, raising) inside the collective: every
    survivor raises a commlab error naming it within two seconds."""
    from commlab.diagnostics.drill import drill

    got = drill(algorithm, fault, world_size=3, collective=collective, delay=DRILL_DELAY)
    for r, o in got["survivors"].items():
        assert o["type"] not in (None, "WRONG DATA", "NO ANSWER") and o["commlab"], (r, o)
        assert "rank 1" in o["msg"] and o["after"] < 2.0, (r, o)


def on_fresh_group(p: int, call) -> tuple[str, str, float]:
    """call(group) on a fresh group of the p ranks (a failed group stays failed: not the
    pool's default one): (the commlab error's type or "returned", its text, seconds)."""
    import time

    import torch.distributed as dist

    from commlab.core.errors import CommlabError

    g = dist.new_group(list(range(p)))
    t0 = time.monotonic()
    try:
        call(g)
    except CommlabError as e:
        return type(e).__name__, str(e), time.monotonic() - t0
    finally:
        dist.destroy_process_group(g)
    return "returned", "", time.monotonic() - t0


class emulated_host:
    """`with emulated_host(h) as group:` this rank on host h (COMMLAB_HOST_ID) in a fresh
    group (host ids are gathered once per group), destroyed on leaving."""

    def __init__(self, host):
        self.host = host

    def __enter__(self):
        import os

        import torch.distributed as dist

        os.environ["COMMLAB_HOST_ID"] = f"h{self.host}"
        self.group = dist.new_group()
        return self.group

    def __exit__(self, *exc):
        import os

        import torch.distributed as dist

        dist.destroy_process_group(self.group)
        del os.environ["COMMLAB_HOST_ID"]


def picked(plan, algorithm: str) -> str:
    """The algorithm a family's plan runs: auto's pick, else the one named."""
    return plan.ctx.transport.name if algorithm == "auto" else algorithm


def picked_for(collective: str, algorithm: str, group, dtype, op=None) -> str:
    """What the family's cached plan for (algorithm, group, dtype[, op]) on CPU runs."""
    import importlib

    plans = importlib.import_module(f"commlab.api.{collective}")._plans
    ids = (id(group),) if op is None else (id(op), id(group))  # the families' keys, op first where they have one
    key = (algorithm, *ids, dtype, True, False)
    return picked(plans.get(key, op), algorithm)


def picks_across_hosts(ranks, name: str, across_hosts, algorithm: str) -> set:
    """across_hosts(rank, p, hosts, algorithm) -> (what it found wrong, what it picked)
    run on the layout `name`: nothing wrong on any rank; returns the set of picks."""
    p, hosts = HOST_LAYOUTS[name]
    got = ranks.run(p, across_hosts, hosts, algorithm)
    assert all(bad == [] for bad, _ in got), got
    return {picked for _, picked in got}


def mismatch_seen(p: int, call) -> tuple[str, str]:
    """call(group) on a fresh group, where ranks call differently: ("mismatch", its text),
    or what else happened (the error's type and text, or "returned")."""
    kind, text, _ = on_fresh_group(p, call)
    return ("mismatch" if kind == "CollectiveMismatchError" else kind), text


def assert_mismatch_alike(got: list, algorithm: str, shm_texts=("shm", "auto", "hier")) -> None:
    """Every rank raised CollectiveMismatchError; where the agreement words it (not
    shared memory, whose record texts say "this rank"), with one text on every rank."""
    assert all(kind == "mismatch" for kind, *_ in got), got
    if algorithm not in shm_texts:
        assert len({text for _, text, *_ in got}) == 1, got


def assert_refusal_named(got: list, says: str) -> None:
    """Rank 1 refused its own arguments: it raised UnsupportedError saying `says`, and
    its peers raised naming it, well before the group's timeout."""
    assert got[1][0] == "UnsupportedError" and says in got[1][1], got
    for r in (0, 2):
        kind, text, took = got[r]
        assert kind != "returned" and "rank 1" in text, got
        assert took < 5, got


# -- what every family's test file shares ---------------------------------------------------

def family_sweep(algorithms: list[str], quick_at_3=None) -> list:
    """(world_size, algorithm) for a family's sweep over 1-5 and 8 ranks (builtin to 4):
    5 and 8 ranks in the slow tier, and 3 ranks too except for quick_at_3 (None: all quick)."""
    import pytest

    cases = [(w, a) for a in algorithms for w in (1, 2, 3, 4, 5, 8) if not (a == "builtin" and w > 4)]
    return [pytest.param(w, a, marks=pytest.mark.slow)
            if w > 4 or (w == 3 and quick_at_3 is not None and a not in quick_at_3) else (w, a) for w, a in cases]


def assert_none_failed(results: list[list[str]]) -> None:
    """Every rank's list of what it found wrong is empty (the first 20 named)."""
    failures = [f for fails in results for f in fails]
    assert not failures, "\n".join(failures[:20])


@contextlib.contextmanager
def halves(rank: int):
    """Ranks 0, 2 and ranks 1, 3 of four as two sub-groups, made (and destroyed) on every
    rank: (this rank's group, its members in order)."""
    import torch.distributed as dist

    evens, odds = dist.new_group([0, 2]), dist.new_group([1, 3])
    try:
        yield (evens, [0, 2]) if rank % 2 == 0 else (odds, [1, 3])
    finally:
        dist.destroy_process_group(evens)
        dist.destroy_process_group(odds)
