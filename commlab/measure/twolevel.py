"""The two-level cost model: one α, β per level a byte moves over (`shm`: shared memory
on a host, `host`: point-to-point inside a host, `link`: the host link), shared by every
algorithm, fitted to runs of several host layouts and extrapolated to a topology and a
link nobody here has (the formulas live with the algorithms: Algorithm.stages)."""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass

import numpy as np

from commlab import algorithms


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
    # scipy.optimize: ~0.3 s, only for a two-level fit
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
