"""compare's view of this host: the compute-only step, the collectives measured on their
own and inside training, the model's sizes, and the prediction the measured rows are
set against (experiments/predict)."""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import tempfile

import torch

from commlab import algorithms
from commlab.experiments import workloads
from commlab.experiments.compare import report
from commlab.experiments.modes import Mode
from commlab.experiments.predict import hardware, per_mode, replicated
from commlab.experiments.predict import sharded as S
from commlab.experiments.predict.sharded import BROADCAST
from commlab.measure import bench, syncprobe
from commlab.measure.probes import measure_first_touch


def _predicted_modes(modes: list[str]) -> list[str]:
    parsed = [Mode.parse(m) for m in modes]
    wanted = [m.name for m in parsed if m.kind in ("dp", "zero1", "fsdp") or (m.kind == "ddp" and not m.backend)]
    return list(dict.fromkeys(wanted))  # this-host runs ddp:noop twice: one predicted column


def predicted(profile: str, modes: list[str], measured: list[dict], args: dict, world: int,
              samples: list[dict] | None = None) -> list[dict]:
    """commlab.predict's rows for the measured modes' setup, each with the same mode
    name and "predicted": true. this-host: `samples` are host_sample()s taken earlier in
    the run (compare takes one after the first compute-only step); one more is taken now,
    and they are pooled."""

    s = replicated.Setup(model=args["model"], world=world, batch_size=args["batch_size"], bucket_cap_mb=args["bucket_cap_mb"],
                         bucket_cap_given=True,  # compare's DDP is always given its cap
                         amp=args["amp"], checkpoint=args["checkpoint"], optimizer=args.get("optimizer", "sgd"),
                         accum_steps=args.get("accum_steps", 1), **workloads.options(args))
    wanted = _predicted_modes(modes)
    if profile == "this-host":
        noop = compute_step(measured)
        if noop is None:
            return [{"mode": m, "status": "unavailable", "predicted": True,
                     "reason": "this-host needs the measured compute-only step (ddp:noop), which failed"} for m in wanted]
        benches, probes = pooled_samples(list(samples or []) + [host_sample(world, modes, args)])

        prof = hardware.this_host(benches, noop["iter_ms"]["median"], world, len(os.sched_getaffinity(0)),
                                  noop.get("arrival_skew_ms", 0.0), noop.get("optimizer_ms"), measure_first_touch(),
                                  noop.get("unit_waits_ms"), probes, noop.get("wait_se_ms"))
    else:
        prof = hardware.load_profile(profile)
    rows = per_mode.predict(wanted, s, prof)
    for r in rows:  # what it was predicted from (this-host: the fits, the compute step), with every row
        r["profile"] = dataclasses.asdict(prof)
    return rows


def compute_step(measured: list[dict]) -> dict | None:
    """this-host's compute-only step from every ddp:noop run of the comparison (the first
    and the last mode, and with --repeat one in every round: the host's cores drift apart
    differently from minute to minute, so one run in a slow phase moved every mode's
    predicted wait together): the iterations pooled, the waits and the optimizer's share
    averaged over the runs' iterations, each wait's ± the steps' or, from three runs, the
    runs' where larger. None when no run finished."""
    runs = [m for m in measured if m["mode"] == "ddp:noop" and m["status"] == "ok"]
    if not runs:
        return None
    weights = [len(m["iteration_ms"]) for m in runs]

    def pooled(values: list) -> tuple[float | None, float | None]:
        """(the mean weighted by the runs' steps, the standard error of that mean when the
        values are themselves standard errors, the runs independent), over the runs that have one."""
        have = [(v, w) for v, w in zip(values, weights) if v is not None]
        if not have:
            return None, None
        steps = sum(w for _, w in have)
        return sum(v * w for v, w in have) / steps, sum((v * w) ** 2 for v, w in have) ** 0.5 / steps

    mean = lambda values: pooled(values)[0]  # noqa: E731
    se = lambda values: pooled(values)[1]  # noqa: E731

    units = [m.get("unit_waits_ms") or {} for m in runs]
    ses = [m.get("wait_se_ms") or {} for m in runs]
    waits = {"step": [m.get("arrival_skew_ms") for m in runs], **{k: [u.get(k) for u in units] for k in units[0]}}

    def wait_se(key: str) -> float | None:
        """The steps' pooled ±, or where three runs or more give the wait and their means
        scatter more (whole runs differ more than their steps on shared cores), the runs'."""
        steps = se([e.get(key) for e in ses])
        have = [v for v in waits.get(key, []) if v is not None]
        runs_se = report.standard_error(have) if len(have) >= 3 else None
        return max((v for v in (steps, runs_se) if v is not None), default=None)

    return {"iter_ms": report.iteration_summary([t / 1e3 for m in runs for t in m["iteration_ms"]]),
            "arrival_skew_ms": mean(waits["step"]) or 0.0,
            "optimizer_ms": mean([m.get("optimizer_ms") for m in runs]),
            "unit_waits_ms": {k: mean([u.get(k) for u in units]) for k in units[0]} if units[0] else None,
            "wait_se_ms": {k: wait_se(k) for k in ses[0]},
            "runs": len(runs)}


def host_sample(world: int, modes: list[str], args: dict) -> dict:
    """What this-host is fitted to besides the compute-only step, measured once: a bench
    of each collective the modes call, and the probes of their calls made after compute
    (probe_in_training: FSDP's, DDP's buckets, ZeRO-1's broadcasts). Taken
    first, in the middle of a comparison of several modes (sample_after) and last, and
    pooled by the median: one sample read the machine's phase at one moment and carried
    it into every mode (docs/measurements.md#figures-behind-the-codes-choices)."""
    wanted = _predicted_modes(modes)
    return {"benches": [host_bench(world, c, names) for c, names in host_collectives(wanted).items()],
            "in_training": probe_in_training(world, wanted, largest_unit_bytes(args), full_bucket_bytes(args),
                                             param_bytes(args), args.get("optimizer", "sgd"))}


def sample_after(runs: int) -> tuple[int, ...]:
    """After which of this-host's `runs` measured runs (the compute-only step first and
    last, the modes between) compare samples the host, besides after the last: after the
    first, and after the middle one where it is not next to the last (one slow moment in
    two samples moved every mode's price by half of it; of three, the median outvotes it)."""
    middle = (runs - 1) // 2
    return (0, middle) if 0 < middle < runs - 2 else (0,)


def pooled_samples(samples: list[dict]) -> tuple[list[dict], dict]:
    """host_sample()s pooled: (one bench per collective, each (algorithm, size)'s time the
    median over the samples that timed it (of two, their mean); the probes, each figure
    the median over samples, with every sample's after_us kept to show how far they
    moved)."""
    benches: dict[str, dict] = {}
    for sample in samples:
        for b in sample["benches"]:
            c = b.get("collective", "all_reduce")
            merged = benches.setdefault(c, {**b, "results": [], "_times": {}, "_gammas": []})
            if b["env"].get("gamma_us_per_byte"):
                merged["_gammas"].append(b["env"]["gamma_us_per_byte"])
            for r in b["results"]:
                merged["_times"].setdefault((r["algorithm"], r["bytes"]), (r, []))[1].append(r["time_us"])
    out = []
    for b in benches.values():
        times, gammas = b.pop("_times"), b.pop("_gammas")
        b["results"] = [dict(r, time_us=statistics.median(ts), samples=len(ts)) for r, ts in times.values()]
        b["env"] = dict(b["env"], **({"gamma_us_per_byte": statistics.median(gammas)} if gammas else {}))
        out.append(b)
    probes: dict = {}
    for sample in samples:
        for c, by in sample["in_training"].items():
            for name, got in by.items():
                probes.setdefault(c, {}).setdefault(name, []).append(got)
    def pool(runs: list[dict]) -> dict:
        got = {k: v for k, v in runs[-1].items() if k != "reused"}
        figures = ("after_us", "exit_spread_us", "wait_us", "wait_mean_us", "work_to_last_us")
        got.update({k: statistics.median(g[k] for g in runs) for k in figures if all(k in g for g in runs)},
                   samples_after_us=[g["after_us"] for g in runs])
        if all("wait_mean_se_us" in g for g in runs):  # as of the mean of independent samples' means
            got["wait_mean_se_us"] = sum(g["wait_mean_se_us"] ** 2 for g in runs) ** 0.5 / len(runs)
        if all("reused" in g for g in runs):  # FSDP's calls into recycled buffers, pooled alike
            got["reused"] = pool([g["reused"] for g in runs])
        return got

    return out, {c: {name: pool(runs) for name, runs in by.items()} for c, by in probes.items()}


def host_collectives(modes: list[str]) -> dict[str, list[str]]:
    """What this-host must fit for these modes: collective -> algorithms."""

    cpu = algorithms.for_device("cpu")
    need: dict[str, list[str]] = {"all_reduce": ["builtin"]}
    for m in map(Mode.parse, modes):
        if m.kind == "ddp" and m.algorithm in cpu:
            need["all_reduce"].append(m.algorithm)
        elif m.kind == "zero1":
            need.setdefault("broadcast", []).append(S.BROADCAST["cpu"])
        elif m.kind == "fsdp":
            for c in ("all_gather", "reduce_scatter"):
                need.setdefault(c, []).append(m.collectives)
    return {c: list(dict.fromkeys(names)) for c, names in need.items()}


def _meta_model(args: dict) -> torch.nn.Module:
    """The compared model on meta tensors: its parameters' shapes, no memory."""
    with torch.device("meta"):
        return workloads.build(args["model"], **workloads.options(args)).model


def largest_unit_bytes(args: dict) -> int:
    """The parameter bytes of the model's largest FSDP unit (a block: workloads.blocks)."""
    sizes = [sum(p.numel() * p.element_size() for p in b.parameters()) for b in workloads.blocks(_meta_model(args))]
    return max(sizes, default=16 << 20)


def param_bytes(args: dict) -> list[int]:
    """Every parameter's bytes, in the model's order (what ZeRO-1 broadcasts after its step)."""
    return [p.numel() * p.element_size() for p in _meta_model(args).parameters()]


def full_bucket_bytes(args: dict) -> int:
    """A full DDP bucket of this model: --bucket-cap-mb (MiB, as DDP reads it), or every
    gradient where they fit in fewer bytes."""
    return max(1, min(int(args["bucket_cap_mb"] * 2**20), sum(param_bytes(args))))


def _ddp_all_reduces(modes: list[str]) -> list[str]:
    """The all-reduce algorithms the DDP-bucketed modes call (zero1: DDP's own)."""
    cpu = algorithms.for_device("cpu")
    parsed = [Mode.parse(m) for m in modes]
    names = [m.all_reduce for m in parsed if not m.backend and m.all_reduce in cpu]  # builtin is a CPU algorithm
    return list(dict.fromkeys(names))


def probe_in_training(world: int, modes: list[str], nbytes: int = 16 << 20, ddp_bytes: int | None = None,
                      params: list[int] | None = None, optimizer: str = "sgd") -> dict:
    """What this-host's modes need beyond the bench, each call made after compute as
    training makes it (measure.syncprobe): FSDP's all-gathers and reduce-scatters into
    fresh buffers at nbytes (compare: the model's largest unit, whose calls are most of
    FSDP's time and whose fresh output's page faults depend on its size); with ddp_bytes,
    DDP's bucket all-reduces in place at that size (what is left of them after backward
    is what the table's "after the last rank arrived" reads); with params (every
    parameter's bytes) and zero1 compared, ZeRO-1's broadcasts of them all, issued and
    waited for together as torch's ZeroRedundancyOptimizer does, each rank's optimizer
    stepping its own parameters before them (the wait at them). $COMMLAB_PROBE_REPS: calls
    per probe (default 12; the docs' examples, run to show they work, take fewer). FSDP's
    calls are probed in both of the allocator's states, the output mapped afresh and
    recycled: the second as the first's "reused"."""

    reps = int(os.environ.get("COMMLAB_PROBE_REPS", syncprobe.REPS))
    calls = [(c, name, nbytes, state)
             for c, names in host_collectives([m for m in modes if Mode.parse(m).kind == "fsdp"]).items()
             if c in ("all_gather", "reduce_scatter") for name in names for state in (syncprobe.FRESH, syncprobe.REUSED)]
    if ddp_bytes:
        calls += [("all_reduce", name, ddp_bytes) for name in _ddp_all_reduces(modes)]
    if params and "zero1" in modes:

        calls.append((syncprobe.ZERO1, BROADCAST["cpu"], list(params), optimizer))
    if calls:
        print("# predicting this-host: " + ", ".join(f"{c} {name}" + (f" ({s[0]})" if s else "")
                                                     for c, name, _, *s in calls)
              + " after compute (syncprobe)", file=sys.stderr, flush=True)
    out: dict = {}
    for (collective, name, _, *state), got in zip(calls, syncprobe.measure_all(world, calls, reps=reps)):
        if state == [syncprobe.REUSED]:  # probed right after its fresh twin
            out[collective][name]["reused"] = got
        else:
            out.setdefault(collective, {})[name] = got
    return out


def host_bench(world: int, collective: str, names: list[str]) -> dict:
    """A short bench of one collective's algorithms at this world size (what this-host
    is fitted to): all-reduce 256 KiB to 16 MiB (DDP's bucket sizes), the sharded
    modes' collectives 4 KiB to 64 MiB (a parameter to a gathered block)."""

    lo, hi = ("256K", "16M") if collective == "all_reduce" else ("4K", "64M")
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "bench.json")
        argv = ["--world-size", str(world), "--collective", collective, "--algorithms", ",".join(names), "-b", lo,
                "-e", hi, "-f", "4", "--anchors", "none", "--budget", os.environ.get("COMMLAB_BENCH_BUDGET", "0.1"),
                "--rounds", "1", "--quiet", "--no-table", "--json", out,
                "--no-floors"]  # the fit reads the rows only: the floors were 2.2 s of an 8 s bench
        command = f"-m commlab.allreduce_bench {' '.join(argv)}"
        print(f"# predicting this-host: {command}", file=sys.stderr, flush=True)
        # Run from this process: its ranks fork from the server compare's modes started, where
        # a `python -m` of it started two fresh interpreters importing torch first.
        if bench.main(argv) != 0:
            raise RuntimeError(f"this-host's bench failed ({command}): see above")
        with open(out) as f:
            return json.load(f)
