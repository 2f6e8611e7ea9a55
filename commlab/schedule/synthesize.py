"""Schedules derived from the topology: sketches whose free parameters a linear program
sets from the links' rates, each proved by the checker and timed by simulation on the
topology (topology.simulate), the fastest chosen — beside the family's fixed schedules
as further candidates, so what it picks is never predicted slower than those.

The sketch (TACCL's idea: fix the shape, let a solver place the bytes) is the one a
star of host links favours: each byte crosses a host link as few times as the
collective allows, and the work inside a host is spread over its ranks.
- all_reduce: reduce inside each host, send each host's partial of every share to the
  share's owner host, reduce there, send the result back, spread it inside hosts; in
  `rounds` segments so one segment's results travel back while the next one's partials
  travel out. The LP chooses each host's share: a host owning x of the buffer carries
  (1 + (H - 2)·x)·N each way, so a slow link's host owns less (nothing, when it can),
  down to the bound (every host carries N each way) where a ring over all ranks
  carries 2(p - 1)/p·N through its slowest link.
- all_gather / reduce_scatter: each rank's block crosses into every other host once
  (all-gather) or each host's partial of a block crosses out once (reduce-scatter), to
  or from a rank of that host chosen round-robin; the owners are the collective's, so
  the LP has nothing to choose.
- all_to_all: every block straight to its rank (on a star no route carries fewer bytes).

Limits: the star (one link per host, a non-blocking switch); messages are whole
pieces, so pipelining is only as deep as `rounds`; the LP has H + 1 variables
(milliseconds), and checking and simulating the candidates is the time (seconds at 16
ranks).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from .build import Builder
from .check import Summary, check
from .ir import Schedule
from .topology import Topology, lower_bound, simulate


@dataclass
class Synthesis:
    schedule: Schedule
    summary: Summary
    predicted: float  # seconds, simulated on the topology
    bound: float  # seconds no schedule beats (topology.lower_bound)
    why: str  # what sets the bound
    candidates: list = field(default_factory=list)  # (name, predicted seconds), fastest first
    shares: list = field(default_factory=list)  # all_reduce: each host's share of the buffer
    solve_s: float = 0.0

    def lines(self) -> list[str]:
        out = [f"chose: {self.schedule.name} (of {len(self.candidates)} candidates, by simulation)"]
        if self.shares:
            out.append("host shares of the reduction (LP): " + ", ".join(f"{x:.3f}" for x in self.shares))
        out += [f"  {name:<40} {t * 1e3:10.2f} ms" for name, t in self.candidates]
        out.append(f"predicted: {self.predicted * 1e3:.2f} ms; lower bound {self.bound * 1e3:.2f} ms ({self.why}); "
                   f"ratio {self.predicted / self.bound:.2f}" if self.bound > 0 else
                   f"predicted: {self.predicted * 1e3:.2f} ms (one host: no link bound)")
        out.append(f"solved and checked in {self.solve_s:.2f} s")
        return out


def shares(topo: Topology) -> list[float]:
    """Each host's share of an all-reduce's buffer: the least time its busiest link
    carries (1 + (H - 2)·x_h)·N / rate_h (an LP), then, among the optima, the shares
    closest to the hosts' rank counts (work inside hosts spread evenly)."""
    from scipy.optimize import linprog  # ~0.3 s to import: only to synthesize

    H, p = len(topo.hosts), topo.size
    if H == 1:
        return [1.0]
    rate = np.array([lk.rate for lk in topo.links]) / max(lk.rate for lk in topo.links)
    # Variables x_0..x_{H-1}, T: minimise T with (1 + (H-2)x_h)/rate_h <= T, Σx = 1.
    a_ub = np.zeros((H, H + 1))
    for h in range(H):
        a_ub[h, h] = (H - 2) / rate[h]
        a_ub[h, H] = -1.0
    b_ub = -1.0 / rate
    eq = np.concatenate([np.ones(H), [0.0]])[None]
    first = linprog(np.r_[np.zeros(H), 1.0], A_ub=a_ub, b_ub=b_ub, A_eq=eq, b_eq=[1.0],
                    bounds=[(0, None)] * (H + 1), method="highs")
    if not first.success:
        raise RuntimeError(f"the share LP failed: {first.message}")
    t = first.x[H] * (1 + 1e-9) + 1e-12
    # Then, among the optimal shares (x_h <= the most host h can carry in time T), the
    # closest to the rank counts in the least-squares sense: water-filling,
    # x_h = clip(n_h/p + λ, 0, most_h) with λ making them sum to 1.
    even = np.array(topo.hosts) / p
    most = (t * rate - 1) / (H - 2) if H > 2 else np.full(H, np.inf)
    lo, hi = -1.0, 1.0
    for _ in range(100):
        lam = (lo + hi) / 2
        lo, hi = (lam, hi) if np.clip(even + lam, 0, most).sum() < 1 else (lo, lam)
    x = np.clip(even + hi, 0, most)
    x = x / x.sum()
    return [float(v) for v in x]


def _split(lo: int, hi: int, parts: int) -> list[tuple[int, int]]:
    """[lo, hi) in `parts` near-equal consecutive ranges (some empty when short)."""
    n = hi - lo
    cuts = [lo + (n * j) // parts for j in range(parts + 1)]
    return [(cuts[j], cuts[j + 1]) for j in range(parts)]


def _counts(x: list[float], total: int) -> list[int]:
    """Shares as whole chunks summing to `total` (largest remainders)."""
    raw = [v * total for v in x]
    out = [int(v) for v in raw]
    for h in sorted(range(len(x)), key=lambda h: raw[h] - out[h], reverse=True)[:total - sum(out)]:
        out[h] += 1
    return out


def all_reduce(topo: Topology, chunks: int | None = None, rounds: int = 4) -> tuple[Schedule, list[float]]:
    """`rounds` consecutive segments of the buffer, each cut by the shares: a segment's
    results travel back while the next one's partials still travel out."""
    p = topo.size
    x = shares(topo)
    # A power of two per segment: a power-of-two buffer then splits with no tail (which
    # the executors run as a second pass of every step).
    per = max(1, chunks // rounds) if chunks else 1 << (8 * p - 1).bit_length()
    counts = _counts(x, per)
    b = Builder("all_reduce", p, per_rank=per * rounds,
                name=f"synth-all_reduce-{'+'.join(map(str, topo.hosts))}", inplace=True)
    for j in range(rounds):
        _all_reduce_segment(b, topo, counts, j * per)
    return b.build(), x


def _all_reduce_segment(b: Builder, topo: Topology, counts: list[int], base: int) -> None:
    H = len(topo.hosts)
    owned, start = [], base  # host h owns counts[h] consecutive chunks of the segment
    for h in range(H):
        owned.append((start, start + counts[h]))
        start += counts[h]
    # Who holds what on host g: each host's range cut among g's ranks (on h itself: its owners).
    holders = []
    for g in range(H):
        mine = topo.ranks_of(g)
        holders.append([(a, z, mine[j]) for lo, hi in owned for j, (a, z) in enumerate(_split(lo, hi, len(mine)))
                        if z > a])
    owners = [piece for h, (lo, hi) in enumerate(owned) for piece in holders[h] if piece[0] >= lo and piece[1] <= hi]

    def across(g):  # (lo, hi, holder on g, owner elsewhere): the intersections
        for lo, hi, rep in holders[g]:
            for a, z, own in owners:
                a, z = max(lo, a), min(hi, z)
                if z > a and topo.host_of(own) != g:
                    yield a, z, rep, own

    for g in range(H):  # 1. inside each host, every rank's piece folded into its holder's
        for lo, hi, rep in holders[g]:
            for q in topo.ranks_of(g):
                if q != rep:
                    b.send(q, ("i", lo), rep, ("i", lo), hi - lo, reduce=True)
    for g in range(H):  # 2. each host's partial of a share to the share's owner, folded there
        for a, z, rep, own in across(g):
            b.send(rep, ("i", a), own, ("i", a), z - a, reduce=True)
    for g in range(H):  # 3. the results back to every other host's holders
        for a, z, rep, own in across(g):
            b.send(own, ("i", a), rep, ("i", a), z - a)
    for g in range(H):  # 4. inside each host, the holders' results to every other rank
        for lo, hi, rep in holders[g]:
            for q in topo.ranks_of(g):
                if q != rep:
                    b.send(rep, ("i", lo), q, ("i", lo), hi - lo)


def _round_robin(topo: Topology, g: int, r: int) -> int:
    """The rank of host g that takes rank r's block from another host."""
    mine = topo.ranks_of(g)
    return mine[r % len(mine)]


def all_gather(topo: Topology) -> Schedule:
    p, H = topo.size, len(topo.hosts)
    b = Builder("all_gather", p, name=f"synth-all_gather-{'+'.join(map(str, topo.hosts))}", inplace=True)
    held = {g: [] for g in range(H)}  # host -> [(rank holding, block)]
    for r in range(p):  # 1. every block into every other host, once
        h = topo.host_of(r)
        held[h].append((r, r))
        for g in range(H):
            if g != h:
                rep = _round_robin(topo, g, r)
                b.send(r, ("o", r), rep, ("o", r))
                held[g].append((rep, r))
    for g in range(H):  # 2. inside each host, each block from whoever holds it to the rest
        for rep, k in held[g]:
            for q in topo.ranks_of(g):
                if q != rep:
                    b.send(rep, ("o", k), q, ("o", k))
    return b.build()


def reduce_scatter(topo: Topology) -> Schedule:
    p, H = topo.size, len(topo.hosts)
    b = Builder("reduce_scatter", p, name=f"synth-reduce_scatter-{'+'.join(map(str, topo.hosts))}", inplace=True)
    for k in range(p):
        h = topo.host_of(k)
        for g in range(H):  # 1. each other host's partial of block k, on one of its ranks
            if g == h:
                continue
            rep = _round_robin(topo, g, k)
            for q in topo.ranks_of(g):
                if q != rep:
                    b.send(q, ("i", k), rep, ("i", k), reduce=True)
            b.send(rep, ("i", k), k, ("i", k), reduce=True)  # 2. ... folded at k
        for q in topo.ranks_of(h):  # and k's host-mates' own
            if q != k:
                b.send(q, ("i", k), k, ("i", k), reduce=True)
    return b.build()


def all_to_all(topo: Topology) -> Schedule:
    p = topo.size
    b = Builder("all_to_all", p, name=f"synth-all_to_all-{'+'.join(map(str, topo.hosts))}")
    for r in range(p):
        b.copy(r, ("i", r), ("o", r))
        for s in range(1, p):  # pairwise order: each rank's s-th message to r + s
            d = (r + s) % p
            b.send(r, ("i", d), d, ("o", r))
    return b.build()


SKETCHES = {"all_reduce": lambda topo, rounds: all_reduce(topo, None, rounds)[0], "all_gather": lambda topo, _: all_gather(topo),
            "reduce_scatter": lambda topo, _: reduce_scatter(topo), "all_to_all": lambda topo, _: all_to_all(topo)}
ROUNDS = (1, 2, 4, 8, 16)  # all_reduce's pipelining depths tried


def synthesize(collective: str, topo: Topology, nbytes: float, others: dict | None = None) -> Synthesis:
    """The fastest, by simulation on `topo` at `nbytes`, of the sketch (all_reduce: at
    each pipelining depth of ROUNDS) and `others` ({name: Schedule}, e.g. the family's
    fixed schedules); every candidate passes the checker first."""
    if collective not in SKETCHES:
        raise ValueError(f"cannot synthesize {collective!r}: one of {', '.join(SKETCHES)}")
    t0 = time.perf_counter()
    x = shares(topo) if collective == "all_reduce" else []
    tried = {}
    for rounds in (ROUNDS if collective == "all_reduce" else (1,)):
        s = SKETCHES[collective](topo, rounds)
        if collective == "all_reduce":
            s.name += f"-r{rounds}"
        tried[s.name] = s
    tried.update(others or {})
    scored = []
    for name, s in tried.items():
        if s.size != topo.size or s.collective != collective:
            continue
        summary = check(s, name)
        scored.append((simulate(s, summary, topo, nbytes), name, s, summary))
    scored.sort(key=lambda c: (c[0], not c[1].startswith("synth")))
    t, _, best, summary = scored[0]
    bound, why = lower_bound(collective, topo, nbytes)
    return Synthesis(best, summary, t, bound, why, [(n, tt) for tt, n, _, _ in scored], x, time.perf_counter() - t0)
