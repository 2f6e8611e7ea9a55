"""A step's prediction for each mode asked: DataParallel's and DDP's priced by replicated.py,
ZeRO-1's and FSDP's by sharded.py (both price with hardware.py's profile), and the largest
batch that fits."""
from __future__ import annotations

from dataclasses import replace

from commlab import algorithms
from commlab.experiments.modes import Mode
from commlab.experiments.predict import hardware, replicated, sharded


def predict(modes: list[str], s: replicated.Setup, prof: hardware.Profile,
            steps: replicated.Steps | None = None) -> list[dict]:
    steps = steps or replicated.Steps(s)
    out = []
    for mode in modes:
        m = Mode.parse(mode)
        if m.kind == "dp":
            out.append(replicated.predict_dp(s, prof, steps))
        elif m.kind == "ddp" and not m.backend:
            alg = m.all_reduce
            if not m.noop and alg not in algorithms.names():
                out.append({"mode": mode, "status": "unavailable", "predicted": True, "reason": f"unknown algorithm {alg!r}"})
                continue
            try:
                out.append(replicated.predict_ddp(mode, s, prof, steps))
            except ValueError as e:
                out.append({"mode": mode, "status": "unavailable", "predicted": True, "reason": str(e)})
        elif m.sharded:
            try:
                out.append(sharded.predict(mode, s, prof, steps))
            except ValueError as e:
                out.append({"mode": mode, "status": "unavailable", "predicted": True, "reason": str(e)})
        else:
            out.append({"mode": mode, "status": "unavailable", "predicted": True,
                        "reason": "predicted modes: dp, ddp, ddp:<algorithm>, ddp:noop, zero1, fsdp, fsdp:noreshard, "
                                  "fsdp:<algorithm>"})
    return out


def max_batch(mode: str, s: replicated.Setup, prof: hardware.Profile, steps: replicated.Steps, limit_bytes: float,
              cap: int = 1 << 14) -> int | None:
    """The largest global batch (a multiple of the world size) whose predicted peak
    memory fits every device."""
    def fits(bs):
        row = predict([mode], replace(s, batch_size=bs), prof, steps)[0]
        return row["status"] == "ok" and max(row["peak_memory_mb"]) * 2**20 <= limit_bytes

    p = s.world
    if not fits(p):
        return None
    lo, hi = p, p
    while hi < cap and fits(hi * 2):
        lo, hi = hi * 2, hi * 2
    hi = min(hi * 2, cap)
    while hi - lo > p:
        mid = (lo + hi) // 2 // p * p
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
