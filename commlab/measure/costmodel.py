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
from dataclasses import asdict, dataclass

import numpy as np

from commlab import algorithms
from commlab.core.cli import run
from commlab.core.errors import UnsupportedError
from commlab.core.units import (
    approx_bytes,
    format_bytes,
    parse_bytes,
    parse_duration_us,
    parse_rate_gbps,
)
from commlab.measure.twolevel import (
    TwoLevel,
    fit_levels,
    holdout,
    load_points,
    parse_topology,
    ranges,
    winners,
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


def _priced(family, alg: str) -> bool:
    """Whether the family prices `alg`: a registered algorithm, or a schedule its
    registry makes from the name (`msccl:PATH`, costed from its own steps)."""
    try:
        family.get(alg)
    except UnsupportedError:
        return False
    return True


def _features(alg: str, p: int, nbytes: float, collective: str = "all_reduce") -> np.ndarray:
    c = algorithms.registry(collective).get(alg).cost(p, nbytes)
    return np.array([c.steps, c.bytes_sent, c.bytes_reduced], dtype=np.float64)


def _nnls_rel(X: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Non-negative least squares on relative error |X·c - t| / t."""
    return _nnls_target(X / t[:, None], np.ones_like(t))


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


def fit(points: list[tuple[str, int, float, float]], gamma_us_per_byte: float | None = None,
        collective: str = "all_reduce") -> dict[str, Fit]:
    """points: (algorithm, world_size, bytes, time_us) of one collective. Algorithms its
    registry does not know (external anchors such as `mpi`) have no formula and are
    skipped. With gamma given, only α and β are fitted, to the time left after the
    reductions."""
    by_alg: dict[str, list[tuple[int, float, float]]] = {}
    family = algorithms.registry(collective)
    known = {alg for alg, *_ in points if _priced(family, alg)}
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
    run(main)
