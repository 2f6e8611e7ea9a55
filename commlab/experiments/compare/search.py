"""--find-max-batch: the largest global batch a mode trains without running out of memory."""
from __future__ import annotations

import sys
from typing import Callable

import torch

from commlab.experiments.modes import Mode


def find_max_batch(mode: str, world: int, args: dict, run: Callable[[str, int, dict], dict]) -> tuple[int | None, list]:
    """The largest global batch (a multiple of the ranks/GPUs) that runs a short training
    without running out of memory: double from --batch-size until a run fails, then
    bisect between the last success and the first failure. Every probe runs in fresh
    processes, like the modes themselves. Returns (batch or None, [(batch, status)])."""
    unit = world if Mode.parse(mode).kind == "ddp" else (args["gpus"] or max(torch.cuda.device_count(), 1))
    probe_args = dict(args, warmup=1, iters=2)
    probes: list[tuple[int, str]] = []

    def runs(batch: int) -> bool | None:
        res = run(mode, world, dict(probe_args, batch_size=batch))
        probes.append((batch, res["status"]))
        print(f"#   {mode}: batch {batch}: {res['status']}", file=sys.stderr, flush=True)
        if res["status"] not in ("ok", "oom"):
            return None  # an error that is not memory: no answer
        return res["status"] == "ok"

    ok, bad = 0, None
    batch = max(unit, (args["batch_size"] // unit) * unit)
    while batch <= args["max_batch_limit"]:
        r = runs(batch)
        if r is None:
            return None, probes
        if not r:
            bad = batch
            break
        ok, batch = batch, batch * 2
    if bad is None:
        return ok or None, probes  # never failed below the limit
    lo, hi = ok, bad  # lo = 0 when the first probe failed: search below it
    while hi - lo > max(unit, hi // 16):  # to within ~6 %: enough to compare modes
        mid = (lo + hi) // 2 // unit * unit
        if mid <= lo:
            break
        r = runs(mid)
        if r is None:
            return None, probes
        if r:
            lo = mid
        else:
            hi = mid
    return lo or None, probes
