"""α-β-γ cost models, fitted to measured times, predicting beyond this machine.

One level: each algorithm's α (per step), β (per byte sent), γ (per byte reduced)
fitted to one bench run (--from). Two levels: one α, β per level a byte moves over
(`shm`: shared memory on a host, `host`: point-to-point inside a host, `link`: the host
link), shared by every algorithm, fitted to runs of several host layouts (--fit, e.g.
the emulated hosts of scripts/emulated_hosts.py), then extrapolated to a topology and a
link nobody here has (--topology, --inter).

The formulas live with the algorithms (Algorithm.cost, Algorithm.stages); this module
only fits and predicts. Fits minimise relative error, since sizes span seven orders of
magnitude and an absolute fit would ignore every small message.

    python -m commlab.costmodel --from results.json --ranks 8,64,512 --bytes 100M
    python -m commlab.costmodel --fit docs/data/costmodel/*.json --holdout
    python -m commlab.costmodel --intra docs/data/costmodel/*.json --topology 64x8,512x8 --inter 100gbit:5us
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
from dataclasses import asdict, dataclass

import numpy as np

from commlab import algorithms
from commlab.measure.units import (
    approx_bytes,
    format_bytes,
    parse_bytes,
    parse_duration_us,
    parse_rate_gbps,
)


@dataclass(frozen=True)
class Fit:
    algorithm: str
    alpha_us: float  # per step
    beta_us_per_byte: float
    gamma_us_per_byte: float
    median_rel_err: float
    max_rel_err: float
    points: int
    collective: str = "all_reduce"

    def predict_us(self, p: int, nbytes: float) -> float:
        c = algorithms.registry(self.collective).get(self.algorithm).cost(p, nbytes)
        return c.time(self.alpha_us, self.beta_us_per_byte, self.gamma_us_per_byte)

    @property
    def bandwidth_gbps(self) -> float:
        """1/β in GB/s (1e9 bytes), the link speed the fit implies."""
        return 1e-3 / self.beta_us_per_byte if self.beta_us_per_byte > 0 else math.inf


def _features(alg: str, p: int, nbytes: float, collective: str = "all_reduce") -> np.ndarray:
    c = algorithms.registry(collective).get(alg).cost(p, nbytes)
    return np.array([c.steps, c.bytes_sent, c.bytes_reduced], dtype=np.float64)


def _nnls_rel(X: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Non-negative least squares on relative error |X·c - t| / t."""
    return _nnls_target(X / t[:, None], np.ones_like(t))


def measure_gamma_us_per_byte(dtype=None, device="cpu", nbytes: int = 8 << 20) -> float:
    """γ measured directly: one in-place element-wise SUM of two nbytes buffers on
    this device (best of 5), per byte of input folded in. Fixing γ from this keeps the
    fit identifiable: for most algorithms bytes sent and bytes reduced are proportional."""
    import time

    import torch

    from commlab.core.reduction import Op, combine_

    dtype = dtype or torch.float32
    n = max(nbytes // torch.empty((), dtype=dtype).element_size(), 1)
    a = torch.zeros(n, dtype=dtype, device=device)
    b = torch.zeros(n, dtype=dtype, device=device)
    best = math.inf
    for _ in range(5):
        if a.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        combine_(a, b, Op.SUM)
        if a.is_cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best * 1e6 / (n * a.element_size())


TOUCH_SIZES = [1 << k for k in range(20, 28)]  # 1-128 MiB by powers of two: 32 MiB (glibc's top threshold) among them


def measure_first_touch(sizes: list[int] = TOUCH_SIZES) -> list[list]:
    """measure_first_touch_us_per_byte at each size, ascending: [[bytes, µs/B], ...]. glibc
    maps an allocation above its mmap threshold afresh (page faults at every first write)
    and raises the threshold to any mapped buffer it frees, up to 32 MiB, after which
    buffers of that size are recycled from the heap, faulting nothing: what a process
    that allocates the same sizes again and again (FSDP's collectives) pays (what fresh
    outputs cost FSDP's all-gathers: docs/measurements.md#figures-behind-the-codes-choices)."""
    return [[n, measure_first_touch_us_per_byte(n)] for n in sorted(sizes)]


def measure_first_touch_us_per_byte(nbytes: int = 48 << 20) -> float:
    """What a freshly allocated host buffer costs per byte the first time it is written,
    beyond writing a warm one (best of 5): an allocation the allocator maps afresh (glibc:
    above its mmap threshold) pays a page fault per page, so every call that allocates its
    output (FSDP's collectives do; the bench reuses its buffers) does."""
    import time

    import torch

    best_fresh = best_warm = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        a = torch.empty(nbytes, dtype=torch.uint8)
        a.fill_(1)
        t1 = time.perf_counter()
        a.fill_(2)
        t2 = time.perf_counter()
        best_fresh, best_warm = min(best_fresh, t1 - t0), min(best_warm, t2 - t1)
        del a
    return max(best_fresh - best_warm, 0.0) * 1e6 / nbytes


def _nnls_target(A: np.ndarray, y: np.ndarray) -> np.ndarray:
    """min |A·c - y|² with c >= 0, by trying every support of the (at most three)
    coefficients: exact for so few unknowns, and no scipy needed."""
    best, best_err = np.zeros(A.shape[1]), math.inf
    for k in range(1, A.shape[1] + 1):
        for cols in itertools.combinations(range(A.shape[1]), k):
            coef, *_ = np.linalg.lstsq(A[:, cols], y, rcond=None)
            if np.any(coef < 0):
                continue
            full = np.zeros(A.shape[1])
            full[list(cols)] = coef
            err = float(np.sum((A @ full - y) ** 2))
            if err < best_err:
                best, best_err = full, err
    return best


FAST_WORKING_SET = 1 << 20  # the staging buffers' size class: cache-resident


def measure_group_bandwidth_gbps(nbytes: int, group=None, trials: int = 3) -> float:
    """Collective: the memory bandwidth each rank gets while every rank of the group
    streams over an nbytes working set at the same time, in GB/s (1e9 B) of bytes read
    plus written. Three patterns, the fastest counts: read only (a sum), copy (half the
    set to the other half) and in place (x += 1, what an all-reduce does to its tensor).
    Each trial starts from a barrier and is timed by its slowest rank, as a collective is.
    This bounds the rate any byte of an all-reduce's traffic can move at this working set
    with these ranks on these cores, so traffic / rate is a floor."""
    import time

    import torch
    import torch.distributed as dist

    n = max(nbytes // 4, 2)
    buf = torch.ones(n, dtype=torch.float32)
    half = n // 2
    patterns = [
        (lambda: buf.sum(), 4 * n),
        (lambda: buf[half:2 * half].copy_(buf[:half]), 2 * 4 * half),
        (lambda: buf.add_(1.0), 2 * 4 * n),
    ]
    best = 0.0
    for fn, moved in patterns:
        fn()  # fault in, warm up
        t0 = time.perf_counter()
        fn()
        # Trials of ~30 ms: long against a scheduler slice, so ranks that share a core
        # share it inside the trial (a short loop would run alone and read too fast).
        reps = torch.tensor([max(1, int(0.03 / max(time.perf_counter() - t0, 1e-7)))], dtype=torch.int64)
        dist.all_reduce(reps, op=dist.ReduceOp.MAX, group=group)
        reps = int(reps.item())
        for _ in range(trials):
            dist.barrier(group=group)
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            best = max(best, moved * reps / float(t.item()) / 1e9)
    return best


def measure_handoffs(group=None, iters: int = 2000, trials: int = 5, timeout_s: float = 10.0) -> dict | None:
    """Collective: what passing a cache line between two ranks' processes costs, from
    ping-pongs through shared memory (rank 0 with each other rank in turn while the rest
    wait; half the best round trip, in µs): `handoff_us` as the ranks run, and, where
    ranks outnumber cores, `switch_us` with the pair pinned to one core (a yield-driven
    context switch, the cheapest kind). Every rank gets the same values, or None if any
    rank could not take part. No shared-memory all-reduce finishes before a peer has
    seen a flag, and a core hosting k ranks must switch k-1 times per call."""
    import torch
    import torch.distributed as dist

    from commlab.core import ext
    from commlab.measure.timing import agree_min

    rank, p = dist.get_rank(group), dist.get_world_size(group)
    if p < 2:
        return None
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(p))
    mine = sorted(os.sched_getaffinity(0))
    facts = [None] * p
    dist.all_gather_object(facts, mine, group=group)
    cores = len(set().union(*map(set, facts)))
    shared = p > cores  # then a waiter yields: its peer may need this very core
    token = [os.urandom(8).hex() if rank == 0 else None]
    dist.broadcast_object_list(token, src=ranks[0], group=group)
    pin = facts[0][0]  # for the switch: both of a pair on rank 0's first CPU
    best = {"handoff_us": float("inf"), "switch_us": float("inf")}
    ok = 1
    for kind in ("handoff_us", "switch_us") if shared else ("handoff_us",):
        for peer in range(1, p):
            for trial in range(trials):
                if rank in (0, peer) and ok:
                    try:
                        if kind == "switch_us":
                            os.sched_setaffinity(0, {pin})
                        ns = ext.require().handoff_pingpong_ns(f"/commlab-handoff-{token[0]}-{kind[0]}{peer}-{trial}",
                                                               rank == 0, iters, shared, int(timeout_s * 1000))
                        best[kind] = min(best[kind], ns / iters / 2 / 1e3)
                    except Exception:  # noqa: BLE001 - no floor rather than no benchmark
                        ok = 0
                    finally:
                        os.sched_setaffinity(0, mine)
                dist.barrier(group=group)
    if not agree_min(ok, torch.device("cpu")):
        return None
    out = torch.tensor([best["handoff_us"], best["switch_us"] if shared else -1.0], dtype=torch.float64)
    dist.broadcast(out, src=ranks[0], group=group)
    return {"handoff_us": float(out[0]), "switch_us": float(out[1]) if shared else None,
            "ranks_per_core": -(-p // cores)}


def hot_copy_us(nbytes: int) -> float:
    """The best time of one memcpy of nbytes between cache-hot buffers, in µs: the least
    an all-reduce spends writing its result into the caller's tensor."""
    from commlab.core import ext

    return ext.require().hot_copy_ns(nbytes, max(100, (64 << 20) // max(nbytes, 1))) / 1e3


def memory_floor_us(traffic, tensor_rate_gbps: float, fast_rate_gbps: float) -> float:
    """A lower bound on one all-reduce's time from its memory traffic per rank: the
    larger of (the caller's tensor bytes at the rate the ranks together get at the
    tensor's working set) and (all bytes, staging included, at the rate they get in a
    cache-sized working set). With rates from measure_group_bandwidth_gbps both terms
    are bounds, so efficiency = floor / time cannot pass 100 %."""
    tensor_s = traffic.tensor / (tensor_rate_gbps * 1e9)
    all_s = (traffic.tensor + traffic.staging) / (fast_rate_gbps * 1e9)
    return max(tensor_s, all_s) * 1e6


def fit(points: list[tuple[str, int, float, float]], gamma_us_per_byte: float | None = None,
        collective: str = "all_reduce") -> dict[str, Fit]:
    """points: (algorithm, world_size, bytes, time_us) of one collective. Algorithms its
    registry does not know (external anchors such as `mpi`) have no formula and are
    skipped. With gamma given, only α and β are fitted, to the time left after the
    reductions."""
    by_alg: dict[str, list[tuple[int, float, float]]] = {}
    known = set(algorithms.registry(collective).names())
    for alg, p, nbytes, t in points:
        if alg in known and t > 0 and nbytes > 0:
            by_alg.setdefault(alg, []).append((p, nbytes, t))
    fits = {}
    for alg, pts in by_alg.items():
        if len(pts) < 2:
            continue
        X = np.stack([_features(alg, p, n, collective) for p, n, _ in pts])
        t = np.array([tt for _, _, tt in pts])
        if gamma_us_per_byte is None:
            a, b, g = _nnls_rel(X, t)
        else:
            g = gamma_us_per_byte
            # Weighted by the full time, so small sizes still count.
            a, b = _nnls_target(X[:, :2] / t[:, None], (t - g * X[:, 2]) / t)
        rel = np.abs(X @ np.array([a, b, g]) - t) / t
        fits[alg] = Fit(alg, float(a), float(b), float(g), float(np.median(rel)), float(rel.max()), len(pts),
                        collective)
    return fits


def points_from_results(doc: dict) -> list[tuple[str, int, float, float]]:
    p = int(doc["env"]["world_size"])
    return [(r["algorithm"], p, float(r["bytes"]), float(r["time_us"])) for r in doc["results"]]


# ---- two levels ------------------------------------------------------------------------

@dataclass(frozen=True)
class Point:
    """One measured time: an algorithm on `hosts` hosts of `per_host` ranks each."""

    algorithm: str
    hosts: int
    per_host: int
    nbytes: float
    time_us: float
    source: str = ""
    share: float = 1.0  # ranks per core on the machine, at least 1: CPU-bound terms stretch by it

    @property
    def layout(self) -> str:
        return f"{self.hosts}x{self.per_host}"


@dataclass
class TwoLevel:
    """β per level (what a byte costs on shared memory, inside a host, on the host
    link) and α per implementation and level (what a step costs: gloo's C++ ring and
    commlab's Python steps differ by far more than any link's latency here)."""

    beta_us_per_byte: dict[str, float]
    alpha_us: dict[str, float]  # "by@level"
    gamma_us_per_byte: float
    median_rel_err: float = 0.0
    max_rel_err: float = 0.0
    points: int = 0

    def predict_us(self, algorithm: str, hosts: int, per_host: int, nbytes: float, share: float = 1.0) -> float | None:
        """None where the algorithm has no derived schedule for the layout or the model
        lacks one of its levels or step costs. `share`: ranks per core on each machine
        (at least 1), which stretches the CPU's work: steps, reductions, bytes on a host.
        A link stage takes the longer of the wire and each rank's own socket copies
        (bytes at the in-host rate: both are the kernel's TCP path)."""
        st = algorithms.get(algorithm).stages(hosts, per_host, nbytes)
        if st is None or any(s.level not in self.beta_us_per_byte or f"{s.by}@{s.level}" not in self.alpha_us
                             for s in st):
            return None
        beta, t = self.beta_us_per_byte, 0.0
        for s in st:
            t += (s.steps * self.alpha_us[f"{s.by}@{s.level}"] + s.reduced * self.gamma_us_per_byte) * share
            if s.level == "link":
                cpu = (s.bytes if s.rank_bytes is None else s.rank_bytes) * beta.get("host", 0.0) * share
                t += max(s.bytes * beta["link"], cpu)
            else:
                t += s.bytes * beta[s.level] * share
        return t

    def with_link(self, rate_gbps: float, latency_us: float | None) -> "TwoLevel":
        """The same model on another host link: β from its rate; each implementation's
        step costs its fitted link step (software plus the emulated link's own few µs),
        or, fitted on one host only, its step inside a host, plus the link's latency."""
        if latency_us is None and not any(k.endswith("@link") for k in self.alpha_us):
            raise ValueError("the fit has no link level: give the link's latency (--inter RATE:LATENCY)")
        alpha = {k: v for k, v in self.alpha_us.items() if not k.endswith("@link")}
        for key, a in self.alpha_us.items():
            by, level = key.split("@")
            if level == "host" and f"{by}@link" not in self.alpha_us or level == "link":
                alpha[f"{by}@link"] = a + (latency_us or 0.0)
        return TwoLevel({**self.beta_us_per_byte, "link": 1e-3 / rate_gbps}, alpha, self.gamma_us_per_byte,
                        self.median_rel_err, self.max_rel_err, self.points)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "TwoLevel":
        return cls(**d)


def layout_points(doc: dict, source: str = "") -> list[Point]:
    """A bench JSON's times (each row's median call) with its host layout (env["ranks_per_host"]:
    ranks per host; runs without it were on one host). Layouts with unequal hosts and
    rows that are not a registered algorithm (anchors, builtin@commlab) are left out."""
    env = doc["env"]
    per_host = env.get("ranks_per_host") or [int(env["world_size"])]
    if len(set(per_host)) != 1:
        return []
    known = set(algorithms.names())
    share = max(1.0, env.get("machine_ranks", per_host[0]) / env["cores"]) if env.get("cores") else 1.0
    return [Point(r["algorithm"], len(per_host), per_host[0], float(r["bytes"]), float(r.get("p50_us", r["time_us"])),
                  source, share)
            for r in doc["results"] if r["algorithm"] in known and r["time_us"] > 0 and r.get("wrong", 0) <= 0]


def fit_levels(points: list[Point], gamma_us_per_byte: float) -> TwoLevel:
    """Non-negative least squares on relative error over every point at once, so each
    level's β is shared by every algorithm and layout; γ as measured (one element-wise
    reduction on this machine), so that bytes sent and bytes reduced, proportional in
    most algorithms, do not trade off against each other. Link stages are fitted on
    their wire term (runs over a slow link, where it is the longer)."""
    from scipy.optimize import nnls

    rows = [(q, st) for q in points if (st := algorithms.get(q.algorithm).stages(q.hosts, q.per_host, q.nbytes))]
    levels = sorted({s.level for _, st in rows for s in st})
    steps = sorted({f"{s.by}@{s.level}" for _, st in rows for s in st})
    cols = {f"beta:{lv}": i for i, lv in enumerate(levels)} | {a: len(levels) + i for i, a in enumerate(steps)}
    if len(rows) < 2 * len(cols):
        raise ValueError(f"too few points ({len(rows)}) to fit {len(cols)} coefficients")
    X = np.zeros((len(rows), len(cols)))
    red = np.zeros(len(rows))
    for i, (q, st) in enumerate(rows):
        for s in st:
            X[i, cols[f"beta:{s.level}"]] += s.bytes * (1.0 if s.level == "link" else q.share)
            X[i, cols[f"{s.by}@{s.level}"]] += s.steps * q.share
            red[i] += s.reduced * q.share
    t = np.array([q.time_us for q, _ in rows])
    scale = np.maximum(X.max(0), 1e-30)  # columns of bytes and of steps differ by 10^6
    c, _ = nnls(X / scale / t[:, None], (t - gamma_us_per_byte * red) / t, maxiter=50 * len(cols))
    c = c / scale
    model = TwoLevel({lv: float(c[cols[f"beta:{lv}"]]) for lv in levels}, {a: float(c[cols[a]]) for a in steps},
                     gamma_us_per_byte, points=len(rows))
    rel = [abs(model.predict_us(q.algorithm, q.hosts, q.per_host, q.nbytes, q.share) - q.time_us) / q.time_us
           for q, _ in rows]
    model.median_rel_err, model.max_rel_err = float(np.median(rel)), float(max(rel))
    return model


def load_points(paths: list[str]) -> tuple[list[Point], float]:
    """Points of several bench JSONs and the γ they measured (the median)."""
    pts, gammas = [], []
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        pts += layout_points(doc, os.path.basename(path))
        if doc["env"].get("gamma_us_per_byte"):
            gammas.append(doc["env"]["gamma_us_per_byte"])
    if not pts:
        raise ValueError(f"no usable points in {paths}")
    return pts, float(np.median(gammas)) if gammas else 0.0


def holdout(points: list[Point], gamma: float) -> dict:
    """Fit on every other size, predict the sizes left out; and fit without each layout
    across hosts whose levels the others still cover, predict that layout. Errors are relative, per
    (layout, algorithm): what the model is worth where it was not fitted."""
    out = {"sizes": {}, "layouts": {}}
    sizes = sorted({q.nbytes for q in points})
    train = set(sizes[::2])
    m = fit_levels([q for q in points if q.nbytes in train], gamma)
    out["sizes"] = _errors(m, [q for q in points if q.nbytes not in train])
    for lay in sorted({q.layout for q in points if q.hosts > 1}):  # across hosts: composed from the others
        rest = [q for q in points if q.layout != lay]
        try:
            m = fit_levels(rest, gamma)
        except ValueError:
            continue
        errs = _errors(m, [q for q in points if q.layout == lay])
        if errs:
            out["layouts"][lay] = errs
    return out


def _errors(model: TwoLevel, points: list[Point]) -> dict:
    by: dict[str, list[float]] = {}
    for q in points:
        t = model.predict_us(q.algorithm, q.hosts, q.per_host, q.nbytes, q.share)
        if t is not None:
            by.setdefault(f"{q.layout} {q.algorithm}", []).append((t - q.time_us) / q.time_us)
    return {k: {"median_rel_err": float(np.median(np.abs(v))), "max_rel_err": float(np.max(np.abs(v))),
                "worst_signed": float(v[int(np.argmax(np.abs(v)))]), "points": len(v)} for k, v in sorted(by.items())}


def parse_topology(text: str) -> tuple[int, int]:
    try:
        h, k = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"not a topology: {text!r} (HOSTSxRANKS, e.g. 64x8)") from None
    if h < 1 or k < 1:
        raise ValueError(f"not a topology: {text!r}")
    return h, k


def winners(model: TwoLevel, hosts: int, per_host: int, names: list[str], lo: float, hi: float,
            share: float = 1.0) -> list[tuple]:
    """[(from_bytes, to_bytes, algorithm)]: the predicted fastest over [lo, hi], each
    crossover located by bisection on the log of the size (to 0.5 %)."""
    return ranges(lambda a, n: model.predict_us(a, hosts, per_host, n, share), names, lo, hi)


def ranges(predict, names: list[str], lo: float, hi: float) -> list[tuple]:
    """[(from_bytes, to_bytes, algorithm)]: the fastest by `predict(algorithm, bytes)` (µs,
    or None where it has no prediction) over [lo, hi], each crossover located by
    bisection on the log of the size (to 0.5 %); ties go to the first name."""
    def best(n):
        ts = {a: predict(a, n) for a in names}
        ts = {a: t for a, t in ts.items() if t is not None}
        return min(ts, key=lambda a: (ts[a], names.index(a))) if ts else None

    grid = np.geomspace(lo, hi, 200)
    out, start, cur = [], lo, best(lo)
    for a, b in zip(grid, grid[1:]):
        wb = best(b)
        if wb == cur:
            continue
        x, y = a, b
        while y / x > 1.005:
            m = math.sqrt(x * y)
            x, y = (m, y) if best(m) == cur else (x, m)
        out.append((start, y, cur))
        start, cur = y, wb
    out.append((start, hi, cur))
    return out


def _link_spec(text: str) -> tuple[float, float | None]:
    rate, _, lat = text.partition(":")
    return parse_rate_gbps(rate), parse_duration_us(lat) if lat else None


def two_level_main(args) -> int:
    paths = args.fit or args.intra
    with open(paths[0]) as f:
        first = json.load(f)
    if len(paths) == 1 and "beta_us_per_byte" in first:  # a fit saved with --save
        model, points = TwoLevel.from_json(first), []
    else:
        points, gamma = load_points(paths)
        points = [q for q in points if q.nbytes >= parse_bytes(args.fit_min_bytes)]
        model = fit_levels(points, gamma)
    out = {"fit": model.to_json(), "sources": paths}
    print(f"# two-level fit: {model.points} points from {len(paths)} file(s); "
          f"fit error median {model.median_rel_err * 100:.1f}%, max {model.max_rel_err * 100:.1f}%")
    print(f"# gamma {model.gamma_us_per_byte * 1e3:.4f} ns/B (measured);  per level: 1/beta in GB/s, "
          f"then each implementation's alpha (us per step)")
    for lv, b in sorted(model.beta_us_per_byte.items()):
        steps = {k.split("@")[0]: a for k, a in model.alpha_us.items() if k.endswith("@" + lv)}
        print(f"  {lv:>5} {1e-3 / b if b else math.inf:9.3f} GB/s   "
              + "  ".join(f"{by} {a:.1f}" for by, a in sorted(steps.items())))
    if points:
        by_layout: dict[str, int] = {}
        for q in points:
            by_layout[q.layout] = by_layout.get(q.layout, 0) + 1
        print("# layouts (hosts x ranks per host): " + ", ".join(f"{k} ({v} points)" for k, v in by_layout.items()))
    if args.holdout and points:
        h = out["holdout"] = holdout(points, model.gamma_us_per_byte)
        for what, title in (("sizes", "fitted on every other size, tested on the others"),
                            ("layouts", "fitted without the layout, tested on it")):
            print(f"# hold-out ({title}):")
            rows = h[what] if what == "sizes" else {k: v for errs in h[what].values() for k, v in errs.items()}
            for key, e in rows.items():
                print(f"  {key:>18}  median {e['median_rel_err'] * 100:5.1f}%  max {e['max_rel_err'] * 100:5.1f}% "
                      f"(worst {e['worst_signed'] * 100:+.0f}%, {e['points']} sizes)")
    if args.topology:
        if args.inter not in (None, "fit"):
            model = model.with_link(*_link_spec(args.inter))
        if "link" not in model.beta_us_per_byte:
            raise SystemExit("no link level: fit runs across hosts, or give --inter RATE[:LATENCY]")
        print(f"# host link: {8e-3 / model.beta_us_per_byte['link']:.3g} Gbit/s each way "
              f"({'--inter ' + args.inter if args.inter not in (None, 'fit') else 'as fitted'}); "
              f"on each host: the levels as fitted")
        lo, hi = parse_bytes(args.min_bytes), parse_bytes(args.max_bytes)
        sizes = [lo << 2 * i for i in range(64) if lo << 2 * i <= hi]
        out["topologies"] = {}
        for topo in args.topology.split(","):
            hosts, k = parse_topology(topo)
            share = max(1.0, k / args.cores) if args.cores else 1.0
            names = [a for a in algorithms.names() if model.predict_us(a, hosts, k, lo) is not None]
            left = [a for a in algorithms.names() if a not in names and a != "auto"]
            print(f"# {hosts} hosts x {k} ranks ({hosts * k} ranks"
                  + (f", {args.cores} cores per host" if args.cores else "") + "): predicted time per all-reduce, us")
            print(f"  {'bytes':>8} " + " ".join(f"{a:>11}" for a in names) + "   fastest")
            rows = []
            for n in sizes:
                ts = {a: model.predict_us(a, hosts, k, n, share) for a in names}
                rows.append({"bytes": n, "time_us": ts})
                print(f"  {format_bytes(n):>8} " + " ".join(f"{ts[a]:11.1f}" for a in names)
                      + f"   {min(ts, key=lambda a: (ts[a], names.index(a)))}")
            spans = winners(model, hosts, k, names, lo, hi, share)
            print("  fastest: " + ";  ".join(f"{approx_bytes(a)}-{approx_bytes(b)} {w}" for a, b, w in spans))
            if left:
                print(f"  not modelled on this layout: {', '.join(left)} (no derived schedule across hosts)")
            out["topologies"][topo] = {"rows": rows, "fastest": [{"from": a, "to": b, "algorithm": w}
                                                                 for a, b, w in spans]}
    if args.save:
        with open(args.save, "w") as f:
            json.dump(model.to_json(), f, indent=2)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m commlab.costmodel", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--from", dest="source", help="one level: JSON written by commlab.allreduce_bench --json")
    ap.add_argument("--fit", nargs="+", help="two levels: bench JSONs of several host layouts (their env.ranks_per_host)")
    ap.add_argument("--intra", nargs="+",
                    help="two levels: what --fit takes, or a fit saved with --save, for the levels on each host")
    ap.add_argument("--topology", help="two levels: HOSTSxRANKS[,...] to predict, e.g. 64x8,512x8")
    ap.add_argument("--inter", help="two levels: the host link, RATE[:LATENCY] (100gbit:5us), or fit (default)")
    ap.add_argument("--cores", type=int, help="two levels: cores per host for --topology (default: one per rank)")
    ap.add_argument("--fit-min-bytes", default="0",
                    help="two levels: fit sizes from here (on a time-shared box small calls measure its scheduler)")
    ap.add_argument("--min-bytes", default="4K")
    ap.add_argument("--max-bytes", default="1G")
    ap.add_argument("--save", help="two levels: write the fit here (for --intra)")
    ap.add_argument("--ranks", default="8,64,512", help="world sizes to predict for")
    ap.add_argument("--bytes", default="100M", help="message sizes to predict for (comma list; 4K, 1M, 1G)")
    ap.add_argument("--holdout", action="store_true",
                    help="fit on every other size and report the error on the sizes left out")
    ap.add_argument("--json", help="write fits and predictions here")
    ap.add_argument("--collective", choices=algorithms.COLLECTIVES,
                    help="one level: the family whose formulas are fitted (default: the one the JSON measured)")
    args = ap.parse_args(argv)
    if args.fit or args.intra:
        try:
            return two_level_main(args)
        except ValueError as e:
            ap.error(str(e))
    if not args.source:
        ap.error("give --from (one level) or --fit/--intra (two levels)")
    with open(args.source) as f:
        doc = json.load(f)
    pts = points_from_results(doc)
    p_measured = int(doc["env"]["world_size"])
    collective = args.collective or doc.get("collective", "all_reduce")
    if doc.get("collective", "all_reduce") != collective:
        ap.error(f"{args.source} measured {doc.get('collective', 'all_reduce')}, not {collective}")
    out = {"collective": collective, "measured_world_size": p_measured, "fits": {}, "predictions": [], "holdout": {},
           "winners": {}}

    if args.holdout:
        sizes = sorted({n for _, _, n, _ in pts})
        train_sizes = set(sizes[::2])
        fits = fit([q for q in pts if q[2] in train_sizes], doc["env"].get("gamma_us_per_byte"), collective)
        print(f"# hold-out check: fit on {len(train_sizes)} sizes, tested on the other {len(sizes) - len(train_sizes)}")
        print(f"# {'algorithm':>12} {'median err':>11} {'max err':>9}")
        for alg, fobj in sorted(fits.items()):
            errs = [abs(fobj.predict_us(p, n) - t) / t for a, p, n, t in pts if a == alg and n not in train_sizes]
            if errs:
                out["holdout"][alg] = {"median_rel_err": float(np.median(errs)), "max_rel_err": float(max(errs))}
                print(f"  {alg:>12} {np.median(errs) * 100:10.1f}% {max(errs) * 100:8.1f}%")

    gamma = doc["env"].get("gamma_us_per_byte")
    fits = fit(pts, gamma, collective)
    print(f"# {collective}: fitted on {p_measured} ranks ({args.source})")
    print(f"# {'algorithm':>12} {'alpha(us)':>10} {'1/beta(GB/s)':>13} {'gamma(ns/B)':>12} {'median err':>11} {'max err':>8}")
    for alg, fobj in sorted(fits.items()):
        out["fits"][alg] = asdict(fobj)
        print(f"  {alg:>12} {fobj.alpha_us:10.2f} {fobj.bandwidth_gbps:13.3f} {fobj.gamma_us_per_byte * 1e3:12.4f} "
              f"{fobj.median_rel_err * 100:10.1f}% {fobj.max_rel_err * 100:7.1f}%")
    ranks = [int(x) for x in args.ranks.split(",") if x]
    sizes = [parse_bytes(x) for x in args.bytes.split(",") if x]
    print("# predictions (same α, β, γ; assumes the network of the measured machine)")
    header = f"# {'bytes':>10} {'ranks':>6} " + " ".join(f"{a:>12}" for a in sorted(fits))
    print(header)
    for n in sizes:
        for p in ranks:
            row = {a: fits[a].predict_us(p, n) for a in sorted(fits)}
            out["predictions"].append({"bytes": n, "ranks": p, "time_us": row})
            best = min(row, key=row.get) if row else "-"
            print(f"  {format_bytes(n):>10} {p:6d} " + " ".join(f"{row[a]:12.1f}" for a in sorted(fits)) + f"   best: {best}")
    lo, hi = parse_bytes(args.min_bytes), parse_bytes(args.max_bytes)
    print(f"# winners per size range, {format_bytes(lo)}-{format_bytes(hi)} (fitted models; auto and external rows left out)")
    names = sorted(a for a in fits if a != "auto")
    for p in ranks:
        spans = ranges(lambda a, n: fits[a].predict_us(p, n), names, lo, hi)
        out["winners"][str(p)] = [{"from_bytes": a, "to_bytes": b, "algorithm": w} for a, b, w in spans]
        print(f"  {p:6d} ranks: " + ", ".join(f"{format_bytes(a)}-{format_bytes(b)} {w}" for a, b, w in spans))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
