"""The seed's table: one row per metric, one column per mode, with the definitions."""
from __future__ import annotations

import statistics

from commlab.measure.timing import percentile

# Printed with the table (a constant, not the docstring: python -OO strips docstrings).
DEFINITIONS = """\
  iteration    wall time of one optimizer step (incl. accumulation micro-steps) of the
               slowest rank; median and p90 after warm-up
  throughput   global batch / median iteration
  peak memory  CPU: peak RSS per rank (getrusage: the true peak, inside a step too);
               GPU: max_memory_allocated per device after warm-up
  utilization  one metric per device type, the same for every mode: CPU: process CPU
               time / wall time per rank (100 % = one core); GPU: NVML's GPU-busy
               percentage per device, sampled at 20 Hz during the timed iterations
               (needs nvidia-ml-py; '-' without it)
  grad sync    DDP: from the hook statistics, per iteration: total = sum of bucket
               all-reduce times, exposed = end of backward compute to the last bucket's
               completion (the part that is not hidden behind backward); `ddp` on GPUs
               over NCCL, whose futures complete at launch: from the device, as ZeRO-1's
               and FSDP's below. DP: one extra
               iteration under torch.profiler, the busiest GPU's time in NCCL kernels
               and peer copies (replicate, gradient reduce-add, scatter, gather); all
               of it exposed, as DP communicates on the compute stream. ZeRO-1 and
               FSDP: on CPU as DDP's buckets plus their blocking collectives (ZeRO-1's
               parameter broadcasts, FSDP's all-gathers and reduce-scatters), exposed
               whole; on a GPU the last warm-up step under torch.profiler, the busiest
               GPU's time in NCCL kernels (total) and the part of it no other kernel
               or copy overlapped (exposed). Of the exposed time, the part after the
               last rank arrived (its end of backward, or its start of each blocking
               collective; one clock per host): the communication itself, the rest
               being a wait for a slower rank. Every
               figure is the largest rank's; predicted: the exposed time charges the
               wait for the last rank predicted from ddp:noop's ends of backward
               (DDP's drifting from one to the next, its optimizer step between;
               ZeRO-1's from the step's start, its broadcasts lining the ranks up
               after the optimizer; ranks that arrived give their cores to the
               rest; FSDP's: the same
               between every pair of units it synchronises at, from ddp:noop's marks
               of each block's forward, backward and backward's end, plus how far
               apart the ranks leave each call), the part after the arrival does not;
               FSDP's calls on this host at their probed ratio to the bench (calls
               after compute: measure.syncprobe), in the middle of the two states
               the allocator may hand each output in (mapped afresh, its pages
               faulted in inside the call, or recycled from the heap). ±: the
               standard error of the mean over the timed steps — measured: of the
               largest rank's exposed time per step; predicted: of the wait
               charged, over ddp:noop's steps (this-host runs it first and last;
               the two pooled), for FSDP with the two states' range (half of it
               over √3: a mixture anywhere in it). With --repeat, a column pools its
               runs: the mean of the runs' figures, ± the standard error over runs
               (predicted: of the wait over ddp:noop's runs where it is larger)
  tensor bytes the peak, over one extra step sampled at every leaf module's forward,
               every gradient's accumulation and after the optimizer step, of the
               bytes of unique storages a rank holds as parameters (sharded, or
               gathered while an FSDP unit computes or is prefetched), gradients,
               optimizer state and DDP's buckets (activations not counted); largest
               rank
  comm / step  bytes of the step's collective buffers, nccl-tests' sizes: DDP's
               all-reduced buckets, ZeRO-1's buckets plus its parameter broadcasts,
               FSDP's gathered outputs and reduce-scattered inputs
  final loss   mean over ranks of the last step's loss
  predicted vs measured  a predicted column's iteration and exposed sync against its
               measured mode's, in per cent; σ: the exposed difference over the two
               standard errors combined (|σ| below 2: within the step-to-step noise)
"""

UTILIZATION_ROW = {"cpu": "utilization (%): CPU time / wall, per rank",
                   "cuda": "utilization (%): NVML GPU busy, per device"}



def iteration_summary(times_s: list[float]) -> dict:
    """Median and p90 of iteration times in ms (the measure.timing percentile)."""
    ordered = sorted(times_s)
    return {"median": percentile(ordered, 0.5) * 1e3, "p90": percentile(ordered, 0.9) * 1e3}


def standard_error(values: list[float]) -> float | None:
    """The standard error of the values' mean (sample standard deviation / sqrt(n)); None below two."""
    return statistics.stdev(values) / len(values) ** 0.5 if len(values) >= 2 else None


def pool_runs(rows: list[dict]) -> dict:
    """One mode's runs under --repeat as one column: its steps pooled (iteration median and
    p90 over all of them), the synchronisation figures the mean over runs with, as their ±,
    the standard error over runs (the spread of the runs' means holds the steps' noise and
    how far whole runs differ, which the steps' ± misses), peak memory per rank the largest
    run's. A run that failed is the column's outcome."""
    for k, r in enumerate(rows):
        if r["status"] != "ok":
            return dict(r, reason=f"run {k + 1} of {len(rows)}: {r['reason']}", runs=len(rows))
    first = rows[0]
    steps = [t for r in rows for t in r["iteration_ms"]]
    iters = iteration_summary([t / 1e3 for t in steps])

    def mean(values):
        return None if any(v is None for v in values) else sum(values) / len(values)

    syncs = [r["grad_sync_ms"] for r in rows]
    sync = {k: mean([s.get(k) for s in syncs]) for k in ("total", "exposed", "after_arrival")}
    if sync["exposed"] and len(rows) > 1:  # ddp:noop's zero has no ±
        runs = [s["exposed"] for s in syncs]
        sync.update(exposed_se=standard_error(runs), exposed_runs=runs)
    out = dict(first, iter_ms=iters, iteration_ms=steps, runs=len(rows), grad_sync_ms=sync,
               samples_per_s=first["samples_per_s"] * first["iter_ms"]["median"] / iters["median"],
               peak_memory_mb=[max(v) if None not in v else None for v in zip(*(r["peak_memory_mb"] for r in rows))],
               util_percent=[mean(list(v)) for v in zip(*(r["util_percent"] for r in rows))])
    for key in ("tensor_mb", "optimizer_ms", "arrival_skew_ms"):
        if all(r.get(key) is not None for r in rows):
            out[key] = (max if key == "tensor_mb" else mean)([r[key] for r in rows])
    if all(r.get("backward_end_ms") is not None for r in rows):  # ddp:noop's, per timed step as iteration_ms
        out["backward_end_ms"] = [t for r in rows for t in r["backward_end_ms"]]
    if all(r.get("unit_waits_ms") for r in rows):
        out["unit_waits_ms"] = {k: mean([r["unit_waits_ms"].get(k) for r in rows]) for k in first["unit_waits_ms"]}
    out.pop("wait_se_ms", None)  # one run's; the predicted ± comes from every run (cli.compute_step)
    if any("trace" in r for r in rows):
        out["trace"] = [r.get("trace") for r in rows]
    out["per_run"] = [{"iter_median_ms": r["iter_ms"]["median"],
                       **{k: r["grad_sync_ms"].get(k) for k in ("total", "exposed", "after_arrival")},
                       **({"arrival_skew_ms": r["arrival_skew_ms"]} if r.get("arrival_skew_ms") is not None else {})}
                      for r in rows]
    return out


def fmt_list(vals, fmt="{:.0f}"):
    if not vals or any(v is None for v in vals):
        return "-"
    if len(set(round(v) for v in vals)) == 1:
        return fmt.format(vals[0]) + f" (x{len(vals)})"
    return "/".join(fmt.format(v) for v in vals)


def prediction_error(pred: dict, modes: list[dict]) -> str:
    """A predicted column's distance from its measured mode: the iteration's and the exposed
    sync's, in per cent, and the latter in standard errors of the difference (σ: the two
    ± combined) where both have one; '-' for a measured column or one measured twice."""
    same = [m for m in modes if m["mode"] == pred["mode"] and not m.get("predicted") and m["status"] == "ok"]
    if not pred.get("predicted") or len(same) != 1:
        return "-"
    meas = same[0]

    def pct(p: float, m: float) -> str:
        return f"{(p - m) / m * 100:+.0f} %" if m else "-"

    cells = [pct(pred["iter_ms"]["median"], meas["iter_ms"]["median"])]
    ps, ms = pred["grad_sync_ms"], meas["grad_sync_ms"]
    if ps.get("exposed") is not None and ms.get("exposed") is not None:
        ses = [x.get("exposed_se") for x in (ps, ms)]
        sigma = sum(e ** 2 for e in ses if e is not None) ** 0.5
        z = f" ({(ps['exposed'] - ms['exposed']) / sigma:+.1f} σ)" if all(e is not None for e in ses) and sigma else ""
        cells.append(pct(ps["exposed"], ms["exposed"]) + z)
    return ", ".join(cells)


def table(doc: dict) -> str:
    modes = doc["modes"]
    ok = [m for m in modes if m["status"] == "ok"]

    def base_of(m):  # predicted columns against the predicted base, measured against the measured
        same = [b for b in ok if bool(b.get("predicted")) == bool(m.get("predicted"))]
        return next((b for b in same if b["mode"] == "dp"), next((b for b in same if b["mode"] == "ddp"), None))

    base = next((base_of(m) for m in modes if base_of(m)), None)
    cols = [m.get("label", m["mode"]) + (" (pred)" if m.get("predicted") else "") for m in modes]
    rows = []

    def row(name, f):
        cells = []
        for m in modes:
            cells.append(f(m) if m["status"] == "ok" else m["status"])
        rows.append(f"| {name} | " + " | ".join(cells) + " |")

    row("iteration median (ms)", lambda m: f"{m['iter_ms']['median']:.1f}")
    row("iteration p90 (ms)", lambda m: f"{m['iter_ms']['p90']:.1f}")
    row("throughput (samples/s)", lambda m: f"{m['samples_per_s']:.1f}")
    if base is not None:
        row(f"speed vs {base['mode']}", lambda m: f"{base_of(m)['iter_ms']['median'] / m['iter_ms']['median']:.2f}x"
            if base_of(m) else "-")
    row("peak memory (MB) per rank/device", lambda m: fmt_list(m["peak_memory_mb"]))
    row(UTILIZATION_ROW[doc["env"].get("device", "cpu")], lambda m: fmt_list(m["util_percent"]))
    row("grad sync total (ms)", lambda m: "-" if m["grad_sync_ms"]["total"] is None else f"{m['grad_sync_ms']['total']:.1f}")
    row("grad sync exposed (ms) ± its standard error", lambda m: "-" if m["grad_sync_ms"]["exposed"] is None
        else f"{m['grad_sync_ms']['exposed']:.1f}" + (f" ± {m['grad_sync_ms']['exposed_se']:.1f}"
                                                     if m["grad_sync_ms"].get("exposed_se") is not None else ""))
    row("  of it after the last rank arrived (ms)", lambda m: "-" if m["grad_sync_ms"].get("after_arrival") is None
        else f"{m['grad_sync_ms']['after_arrival']:.1f}")
    if any(m.get("predicted") for m in ok):
        row("predicted vs measured: iteration, exposed (σ)", lambda m: prediction_error(m, modes))
    if any(m.get("tensor_mb") is not None for m in ok):
        row("tensor bytes peak (MB): params+grads+optimizer+buckets",
            lambda m: "-" if m.get("tensor_mb") is None else f"{m['tensor_mb']:.1f}")
        row("comm per step (MB)", lambda m: "-" if m.get("comm_mb") is None else f"{m['comm_mb']:.1f}")
    row("final loss", lambda m: "-" if m.get("final_loss") is None else f"{m['final_loss']:.5f}")
    if any("max_batch" in m for m in modes):
        rows.append("| max batch before OOM | " + " | ".join(
            "-" if "max_batch" not in m else (str(m["max_batch"]) if m["max_batch"] else "none found")
            for m in modes) + " |")
    head = "| metric | " + " | ".join(cols) + " |\n|---|" + "---|" * len(cols)
    notes = [f"- {m.get('label', m['mode'])}: {m['status']}: {m['reason']}" for m in modes if m["status"] != "ok"]
    return "\n".join([head] + rows + ([""] + notes if notes else []))
