"""α-β-γ cost model: fit each algorithm's α (per step), β (per byte sent) and γ (per
byte reduced) to measured times, then predict beyond this machine.

The formulas live with the algorithms (Algorithm.cost); this module only fits and
predicts. The fit minimises relative error, since sizes span seven orders of magnitude
and an absolute fit would ignore every small message.

    python -m commlab.costmodel --from results.json --ranks 8,64,512 --bytes 100M
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
from commlab.measure.units import format_bytes, parse_bytes


@dataclass(frozen=True)
class Fit:
    algorithm: str
    alpha_us: float  # per step
    beta_us_per_byte: float
    gamma_us_per_byte: float
    median_rel_err: float
    max_rel_err: float
    points: int

    def predict_us(self, p: int, nbytes: float) -> float:
        c = algorithms.get(self.algorithm).cost(p, nbytes)
        return c.time(self.alpha_us, self.beta_us_per_byte, self.gamma_us_per_byte)

    @property
    def bandwidth_gbps(self) -> float:
        """1/β in GB/s (1e9 bytes), the link speed the fit implies."""
        return 1e-3 / self.beta_us_per_byte if self.beta_us_per_byte > 0 else math.inf


def _features(alg: str, p: int, nbytes: float) -> np.ndarray:
    c = algorithms.get(alg).cost(p, nbytes)
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


def fit(points: list[tuple[str, int, float, float]], gamma_us_per_byte: float | None = None) -> dict[str, Fit]:
    """points: (algorithm, world_size, bytes, time_us). Algorithms the registry does
    not know (external anchors such as `mpi`) have no formula and are skipped. With
    gamma given, only α and β are fitted, to the time left after the reductions."""
    by_alg: dict[str, list[tuple[int, float, float]]] = {}
    known = set(algorithms.names())
    for alg, p, nbytes, t in points:
        if alg in known and t > 0 and nbytes > 0:
            by_alg.setdefault(alg, []).append((p, nbytes, t))
    fits = {}
    for alg, pts in by_alg.items():
        if len(pts) < 2:
            continue
        X = np.stack([_features(alg, p, n) for p, n, _ in pts])
        t = np.array([tt for _, _, tt in pts])
        if gamma_us_per_byte is None:
            a, b, g = _nnls_rel(X, t)
        else:
            g = gamma_us_per_byte
            # Weighted by the full time, so small sizes still count.
            a, b = _nnls_target(X[:, :2] / t[:, None], (t - g * X[:, 2]) / t)
        rel = np.abs(X @ np.array([a, b, g]) - t) / t
        fits[alg] = Fit(alg, float(a), float(b), float(g), float(np.median(rel)), float(rel.max()), len(pts))
    return fits


def points_from_results(doc: dict) -> list[tuple[str, int, float, float]]:
    p = int(doc["env"]["world_size"])
    return [(r["algorithm"], p, float(r["bytes"]), float(r["time_us"])) for r in doc["results"]]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m commlab.costmodel", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--from", dest="source", required=True, help="JSON written by commlab.allreduce_bench --json")
    ap.add_argument("--ranks", default="8,64,512", help="world sizes to predict for")
    ap.add_argument("--bytes", default="100M", help="message sizes to predict for (comma list; 4K, 1M, 1G)")
    ap.add_argument("--holdout", action="store_true",
                    help="fit on every other size and report the error on the sizes left out")
    ap.add_argument("--json", help="write fits and predictions here")
    args = ap.parse_args(argv)
    with open(args.source) as f:
        doc = json.load(f)
    pts = points_from_results(doc)
    p_measured = int(doc["env"]["world_size"])
    out = {"measured_world_size": p_measured, "fits": {}, "predictions": [], "holdout": {}}

    if args.holdout:
        sizes = sorted({n for _, _, n, _ in pts})
        train_sizes = set(sizes[::2])
        fits = fit([q for q in pts if q[2] in train_sizes], doc["env"].get("gamma_us_per_byte"))
        print(f"# hold-out check: fit on {len(train_sizes)} sizes, tested on the other {len(sizes) - len(train_sizes)}")
        print(f"# {'algorithm':>12} {'median err':>11} {'max err':>9}")
        for alg, fobj in sorted(fits.items()):
            errs = [abs(fobj.predict_us(p, n) - t) / t for a, p, n, t in pts if a == alg and n not in train_sizes]
            if errs:
                out["holdout"][alg] = {"median_rel_err": float(np.median(errs)), "max_rel_err": float(max(errs))}
                print(f"  {alg:>12} {np.median(errs) * 100:10.1f}% {max(errs) * 100:8.1f}%")

    gamma = doc["env"].get("gamma_us_per_byte")
    fits = fit(pts, gamma)
    print(f"# fitted on {p_measured} ranks ({args.source})")
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
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
