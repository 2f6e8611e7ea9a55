"""DP vs DDP, measured: the seed article's table, every mode in fresh processes.

    python -m commlab.compare --device cpu --world-size 4            # CPU default (~2 minutes here)
    python -m commlab.compare --device cuda --gpus 4 --model resnet50 --batch-size 256
    python -m commlab.compare --modes dp,ddp,ddp:ring,ddp:noop --json c.json --plot c.png
    python -m commlab.compare --device cuda --mem-limit-mb 24000 --find-max-batch   # a 24 GB card's limit
    python -m commlab.compare --device cpu --modes ddp,ddp:shm --bucket-cap-mb 1,5,25,100

Modes: `dp` (nn.DataParallel, one process, GPUs only); `ddp` (DDP with its default
reduction, made measurable: a comm hook that divides the bucket by the world size and
calls dist.all_reduce on DDP's process group, as DDP's built-in allreduce hook does, and
times each bucket); `ddp:<algorithm>` (DDP through commlab's hook for that algorithm);
`ddp:noop` (no communication: the compute-only floor); `ddp@commlab` (`ddp` with its
process group on commlab's torch.distributed backend: the same dist.all_reduce, served
by commlab's `auto`; CPU). The sharded modes: `zero1` (DDP + torch's
ZeroRedundancyOptimizer), `fsdp` (FSDP2 fully_shard per block, torch's collectives),
`fsdp:noreshard` (reshard_after_forward=False, ZeRO-2-like) — on CPU and on GPUs over
NCCL — and `fsdp:<algorithm>` (FSDP's all-gathers and reduce-scatters through commlab's
families; CPU); with any of them the optimizer is AdamW for every mode (and on CPU the
model the transformer). Every mode trains the
same model from the same seed on the same synthetic data.

    python -m commlab.compare --device cpu --world-size 4 --model transformer --width 1024 --depth 8 \
        --modes ddp,zero1,fsdp,fsdp:shm,fsdp:noreshard
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import sys

import torch

from commlab import algorithms
from commlab.measure import envinfo, pools, trace
from commlab.measure.launch import check_gpus_per_rank
from commlab.training import fsdp, workloads
from commlab.training.compare import report, search, sharded, workers
from commlab.training.modes import is_sharded


def default_modes(device: str) -> list[str]:
    wanted = ["dp", "ddp", "ddp:ring", "ddp:ps", "ddp:shm", "ddp:noop"] + _backend_modes(device)
    return [m for m in wanted if not m.startswith("ddp:") or m == "ddp:noop" or m[4:] in algorithms.for_device(device)]


def all_modes(device: str) -> list[str]:
    return ["dp", "ddp"] + [f"ddp:{a}" for a in algorithms.for_device(device)] + ["ddp:noop"] + _backend_modes(device) \
        + _sharded_modes(device)


def _sharded_modes(device: str) -> list[str]:
    """ZeRO-1 and FSDP2; FSDP's collectives through commlab on CPU only (its algorithms
    serve FSDP2 there; on a GPU FSDP2 waits on torch's Work, which commlab's handle is not)."""
    return ["zero1", "fsdp", "fsdp:noreshard"] + ([f"fsdp:{a}" for a in fsdp.algorithms()] if device == "cpu" else [])


def _sharded_refusal(args: dict) -> str | None:
    """Why a sharded mode cannot run on this GPU setup, or None."""
    if args["device"] == "cuda" and args["share_gpu"]:
        return "the sharded modes run over NCCL with a GPU per rank; --share-gpu runs gloo, whose CUDA " \
               "collectives FSDP2 does not use"
    return None


def _backend_modes(device: str) -> list[str]:
    """DDP's default reduction with the process group on commlab's backend (CPU tensors)."""
    return ["ddp@commlab"] if device == "cpu" else []


def _is_ddp(mode: str) -> bool:
    return mode == "ddp" or mode.startswith("ddp:") or mode.startswith("ddp@")


def _failed(mode: str, outcomes: dict, timeout: float) -> dict:
    """The row of a mode some rank did not finish: oom when a rank ran out of memory."""
    bad = {r: o for r, o in outcomes.items() if o.status != "ok"}
    oom = any(o.error_type == "OutOfMemoryError" for o in bad.values())
    missing = [r for r, o in bad.items() if o.status == "missing"]
    reason = (f"ranks {missing} did not finish within {timeout:.0f}s; " if missing else "") + "; ".join(
        f"rank {r}: {o.error.strip().splitlines()[-1]}" for r, o in sorted(bad.items()) if o.status == "error")
    return {"mode": mode, "status": "oom" if oom else "error", "reason": reason}


def run_ddp_mode(mode: str, world: int, args: dict, rank_fn=workers.ddp_rank) -> dict:
    outcomes = pools.run_once(world, rank_fn, mode, args, timeout=args["mode_timeout"], threads=args["threads"])
    if any(o.status != "ok" for o in outcomes.values()):
        return _failed(mode, outcomes, args["mode_timeout"])
    res = [outcomes[r].result for r in range(world)]
    iters = report.iteration_summary(res[0]["times"])
    exposed = max(r["sync_exposed"] for r in res)
    # The part of it after the last rank arrived: communication, not waiting for a slower rank.
    split = trace.exposed_split([r["trace"] for r in res]) if res[0].get("trace") else {}
    after = split.get("after_arrival")
    se = report.standard_error(split.get("exposed_per_iteration") or [])  # how much it moves step to step
    return {
        "mode": mode, "status": "ok", "reason": "",
        "iter_ms": iters,
        "iteration_ms": [t * 1e3 for t in res[0]["times"]],  # every timed step, the slowest rank's
        "samples_per_s": args["batch_size"] / (iters["median"] / 1e3),
        "peak_memory_mb": [r["memory_mb"] for r in res],
        "util_percent": [r["util"] for r in res],
        "grad_sync_ms": {"total": max(r["sync_total"] for r in res), "exposed": exposed,
                         "after_arrival": after if after is not None else (0.0 if exposed == 0 else None),
                         **({"exposed_se": se} if se is not None else {})},
        "final_loss": res[0]["loss"],
        # ddp:noop: what this-host's wait for the last rank is predicted from, per timed iteration.
        **({"arrival_skew_ms": res[0]["arrival_skew_ms"], "backward_end_ms": res[0]["backward_end_ms"],
            "unit_waits_ms": res[0]["unit_waits_ms"], "wait_se_ms": res[0]["wait_se_ms"]}
           if res[0].get("unit_waits_ms") is not None else {}),  # DDP's skew needs a step before: may be None
        **({"optimizer_ms": max(r["optimizer_ms"] for r in res)} if res[0].get("optimizer_ms") is not None else {}),
        **({"tensor_mb": max(r["tensor_mb"] for r in res),
            "tensor_breakdown_mb": max(res, key=lambda r: r["tensor_mb"])["tensor_breakdown_mb"]}
           if res[0].get("tensor_mb") is not None else {}),
        "comm_mb": max(r.get("comm_bytes", 0) for r in res) / 2**20,
        **({"params": res[0]["params"]} if res[0].get("params") is not None else {}),
        **({"trace_records": [r["trace"] for r in res]} if args.get("trace") and res[0].get("trace") else {}),
    }


def run_dp_mode(args: dict) -> dict:
    if args["device"] != "cuda" or not torch.cuda.is_available():
        return {"mode": "dp", "status": "unavailable",
                "reason": "nn.DataParallel replicates a module across CUDA devices inside one process; no CUDA device here"}
    outcomes = pools.run_once(1, workers.dp_process, args, timeout=args["mode_timeout"], threads=args["threads"])
    if outcomes[0].status != "ok":
        return _failed("dp", outcomes, args["mode_timeout"])
    return outcomes[0].result


def run_mode(mode: str, world: int, args: dict) -> dict:
    device = args["device"]
    if mode == "dp":
        return run_dp_mode(args)
    if mode in ("ddp", "ddp:noop") or (mode.startswith("ddp:") and mode[4:] in algorithms.for_device(device)) \
            or mode in _backend_modes(device):
        return run_ddp_mode(mode, world, args)
    if mode in _sharded_modes(device):
        refusal = _sharded_refusal(args)
        if refusal:
            return {"mode": mode, "status": "unavailable", "reason": refusal}
        return run_ddp_mode(mode, world, args, sharded.sharded_rank)
    return {"mode": mode, "status": "unavailable",
            "reason": f"no such mode for {device} (modes: {', '.join(all_modes(device))})"}


def _predicted_modes(modes: list[str]) -> list[str]:
    wanted = [m for m in modes if m == "dp" or m == "ddp" or m.startswith("ddp:") or is_sharded(m)]
    return list(dict.fromkeys(wanted))  # this-host runs ddp:noop twice: one predicted column


def predicted(profile: str, modes: list[str], measured: list[dict], args: dict, world: int,
              samples: list[dict] | None = None) -> list[dict]:
    """commlab.predict's rows for the measured modes' setup, each with the same mode
    name and "predicted": true. this-host: `samples` are host_sample()s taken earlier in
    the run (compare takes one after the first compute-only step); one more is taken now,
    and they are pooled."""
    from commlab.training.predict import model as M
    from commlab.training.predict import per_mode

    s = M.Setup(model=args["model"], world=world, batch_size=args["batch_size"], bucket_cap_mb=args["bucket_cap_mb"],
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
        from commlab.measure.costmodel import measure_first_touch

        prof = M.this_host(benches, noop["iter_ms"]["median"], world, len(os.sched_getaffinity(0)),
                           noop.get("arrival_skew_ms", 0.0), noop.get("optimizer_ms"), measure_first_touch(),
                           noop.get("unit_waits_ms"), probes, noop.get("wait_se_ms"))
    else:
        prof = M.load_profile(profile)
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
    first, in the middle of a comparison of several modes (_sample_after) and last, and
    pooled by the median: one sample read the machine's phase at one moment and carried
    it into every mode (docs/measurements.md#figures-behind-the-codes-choices)."""
    wanted = _predicted_modes(modes)
    return {"benches": [host_bench(world, c, names) for c, names in host_collectives(wanted).items()],
            "in_training": probe_in_training(world, wanted, largest_unit_bytes(args), full_bucket_bytes(args),
                                             param_bytes(args), args.get("optimizer", "sgd"))}


def _sample_after(runs: int) -> tuple[int, ...]:
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
    from commlab.training.predict import sharded as S

    cpu = algorithms.for_device("cpu")
    need: dict[str, list[str]] = {"all_reduce": ["builtin"]}
    for m in modes:
        if m.startswith("ddp:") and m[4:] in cpu:
            need["all_reduce"].append(m[4:])
        elif m == "zero1":
            need.setdefault("broadcast", []).append(S.BROADCAST["cpu"])
        elif is_sharded(m):
            for c in ("all_gather", "reduce_scatter"):
                need.setdefault(c, []).append(S.fsdp_algorithm(m))
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
    names = ["builtin" if m in ("ddp", "zero1") else m[4:] for m in modes
             if m in ("ddp", "zero1") or (m.startswith("ddp:") and m[4:] in cpu)]
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
    from commlab.measure import syncprobe

    reps = int(os.environ.get("COMMLAB_PROBE_REPS", syncprobe.REPS))
    calls = [(c, name, nbytes, state)
             for c, names in host_collectives([m for m in modes if m.startswith("fsdp")]).items()
             if c in ("all_gather", "reduce_scatter") for name in names for state in (syncprobe.FRESH, syncprobe.REUSED)]
    if ddp_bytes:
        calls += [("all_reduce", name, ddp_bytes) for name in _ddp_all_reduces(modes)]
    if params and "zero1" in modes:
        from commlab.training.predict.sharded import BROADCAST

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
    import subprocess
    import tempfile

    lo, hi = ("256K", "16M") if collective == "all_reduce" else ("4K", "64M")
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "bench.json")
        cmd = [sys.executable, "-m", "commlab.allreduce_bench", "--world-size", str(world), "--collective", collective,
               "--algorithms", ",".join(names), "-b", lo, "-e", hi, "-f", "4", "--anchors", "none",
               "--budget", os.environ.get("COMMLAB_BENCH_BUDGET", "0.1"), "--rounds", "1", "--quiet", "--json", out,
               "--no-floors"]  # the fit reads the rows only: the floors were 2.2 s of an 8 s bench
        print(f"# predicting this-host: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=600)
        with open(out) as f:
            return json.load(f)


def write_trace(records: list[dict], label: str, directory: str) -> dict:
    """One mode's trace as DIR/<label>.json and, with matplotlib, DIR/<label>.png; the
    row keeps the paths and the sync figures read back from the trace."""
    os.makedirs(directory, exist_ok=True)
    name = re.sub(r"[^\w.:-]+", "_", label)
    doc = trace.chrome_trace(records, label)
    out = {"json": os.path.join(directory, name + ".json"), "sync_ms": trace.sync_ms(doc)}
    trace.write(doc, out["json"])
    try:
        from commlab.measure.plots import plot_trace

        plot_trace(doc, os.path.join(directory, name + ".png"))
        out["png"] = os.path.join(directory, name + ".png")
    except SystemExit as e:  # no matplotlib: the JSON alone, and why
        out["png_skipped"] = str(e)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m commlab.compare", description=__doc__,
                                 epilog="Metric definitions:\n" + report.DEFINITIONS,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    ap.add_argument("--world-size", type=int, default=None, help="DDP ranks (default: 4 on CPU, every GPU on CUDA)")
    ap.add_argument("--gpus", type=int, default=None, help="GPUs for dp and ddp (default: all)")
    ap.add_argument("--modes", default=None, help="comma list, or all (default: dp, ddp, ddp:ring, ddp:ps, ddp:shm, ddp:noop, and ddp@commlab on CPU)")
    ap.add_argument("--model", default=None, help="mlp | transformer | any torchvision model | package.module:factory "
                    "(your own: a callable returning the module, or (module, example input batch)); default: mlp on "
                    "CPU, resnet50 on GPU")
    ap.add_argument("--input-shape", help="one sample's shape for a factory model, e.g. 3,224,224 (else the "
                    "factory's example input)")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=64, help="global batch")
    ap.add_argument("--bucket-cap-mb", default="25",
                    help="DDP bucket size in MB; a comma list (1,5,25,100) sweeps it for every communicating DDP mode")
    ap.add_argument("--amp", choices=["fp16", "bf16"], default=None)
    ap.add_argument("--checkpoint", action="store_true", help="gradient checkpointing (activations recomputed in backward)")
    ap.add_argument("--accum-steps", type=int, default=1, help="gradient accumulation with no_sync()")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=1,
                    help="every mode this many times in fresh processes, in rounds (a slow phase of the machine falls "
                         "on every mode alike); one column per mode, its sync figures the mean over runs, their ± the "
                         "standard error over runs: on shared cores whole runs differ more than their steps")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--optimizer", choices=["sgd", "adamw"], default=None,
                    help="every mode's optimizer (default: adamw when a sharded mode (zero1, fsdp*) is compared, "
                         "where optimizer state is what sharding saves; else sgd)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--timeout", type=float, default=120.0, help="process-group timeout (s)")
    ap.add_argument("--mode-timeout", type=float, default=300.0, help="wall-clock limit per mode (s)")
    ap.add_argument("--find-max-batch", action="store_true",
                    help="per mode, the largest global batch that trains without running out of memory (doubling, "
                         "then bisection; short runs)")
    ap.add_argument("--max-batch-limit", type=int, default=1 << 14, help="stop --find-max-batch searching here")
    ap.add_argument("--mem-limit-mb", type=float, default=None,
                    help="memory per device as if the card had this much (GPU: allocator cap, real OOM; "
                         "CPU: emulated on what training adds to each rank's peak RSS)")
    ap.add_argument("--share-gpu", action="store_true", help="several DDP processes on one GPU over gloo (functional check)")
    ap.add_argument("--predict", help="a hardware profile (commlab.predict's, or this-host: fitted to a bench run on "
                    "this machine and the measured ddp:noop): its predicted column beside each measured mode")
    ap.add_argument("--trace", metavar="DIR", help="CPU modes: every rank's forward, backward, optimizer, DDP bucket "
                    "and blocking-collective spans as DIR/<mode>.json (Chrome trace events: Perfetto, "
                    "chrome://tracing) and DIR/<mode>.png (needs matplotlib); off by default")
    ap.add_argument("--json"), ap.add_argument("--plot")
    a = ap.parse_args(argv)
    args = vars(a)
    if a.device == "cuda" and a.warmup < 1:
        ap.error("--device cuda needs --warmup 1 or more: the last warm-up step is profiled for the collectives' "
                 "device time (NCCL completes a collective's future at launch; FSDP2 runs them on its own streams)")
    pools.preload("torch._dynamo")  # every DDP constructor imports it: once in the ranks' server, not in each rank
    try:
        caps = [float(c) for c in str(a.bucket_cap_mb).split(",") if c.strip()]
    except ValueError:
        ap.error(f"--bucket-cap-mb takes numbers, comma-separated for a sweep: {a.bucket_cap_mb!r}")
    if not caps or min(caps) <= 0:
        ap.error("--bucket-cap-mb must be positive")
    args["bucket_cap_mb"] = caps[0]
    modes = all_modes(a.device) if a.modes == "all" else (a.modes.split(",") if a.modes else default_modes(a.device))
    any_sharded = any(is_sharded(m) for m in modes)
    if a.model is None:
        args["model"] = "resnet50" if a.device == "cuda" else ("transformer" if any_sharded else "mlp")
    if a.optimizer is None:
        args["optimizer"] = "adamw" if any_sharded else "sgd"
    try:
        args["input_shape"] = workloads.parse_shape(a.input_shape)
        with torch.device("meta"):  # a wrong model fails here, once, not on every rank
            workloads.build(args["model"], **workloads.options(args))
    except ValueError as e:
        ap.error(str(e))
    world = a.world_size or (4 if a.device == "cpu" else (a.gpus or torch.cuda.device_count()))
    if a.device == "cuda" and not a.share_gpu:
        problem = check_gpus_per_rank(world, "nccl", torch.cuda.device_count())
        if problem:
            ap.error(problem + " (or pass --share-gpu for a functional check over gloo)")
    if a.repeat < 1:
        ap.error("--repeat must be 1 or more")
    if a.predict == "this-host":
        # This host's compute is measured, not read off a datasheet: first and last (compute_step),
        # and in every round.
        modes = (["ddp:noop"] + [m for m in modes if m != "ddp:noop"]) * a.repeat + ["ddp:noop"]
    else:
        modes = modes * a.repeat
    env = envinfo.collect(torch.device("cpu"))
    env.update(world_size=world, device=a.device, model=args["model"], batch_size=a.batch_size,
               bucket_cap_mb=caps if len(caps) > 1 else caps[0], mem_limit_mb=a.mem_limit_mb, amp=a.amp,
               checkpoint=a.checkpoint, accum_steps=a.accum_steps, share_gpu=a.share_gpu, optimizer=args["optimizer"],
               **({"repeat": a.repeat} if a.repeat > 1 else {}))
    if a.share_gpu:
        env["note"] = "--share-gpu: all DDP ranks on one GPU over gloo, a functional check, not a speed figure"
    results, samples = [], []
    for n, mode in enumerate(modes):
        # bucket_cap_mb shapes DDP's gradient buckets: swept for the modes that communicate.
        for cap in (caps if _is_ddp(mode) and mode != "ddp:noop" else caps[:1]):
            margs = dict(args, bucket_cap_mb=cap)
            label = f"{mode} @{cap:g}MB" if len(caps) > 1 and _is_ddp(mode) and mode != "ddp:noop" else mode
            if a.repeat == 1 and modes.count(mode) > 1:  # this-host's compute-only step, run first and last
                label = f"{mode} ({'first' if n == modes.index(mode) else 'last'})"
            run = modes[:n].count(mode) + 1  # which of this mode's runs (--repeat)
            print(f"# running {label}" + (f" (run {run} of {modes.count(mode)})" if a.repeat > 1 else "") + " ...",
                  file=sys.stderr, flush=True)
            res = run_mode(mode, world, margs)
            if _is_ddp(mode):
                res["bucket_cap_mb"] = cap
            if label != mode:
                res["label"] = label
            records = res.pop("trace_records", None)
            if a.trace and records:
                res["trace"] = write_trace(records, label + (f" run {run}" if a.repeat > 1 else ""), a.trace)
            if a.find_max_batch and res["status"] in ("ok", "oom") and run == 1:
                res["max_batch"], res["max_batch_probes"] = search.find_max_batch(mode, world, margs, run_mode)
            results.append(res)
        if a.predict == "this-host" and n in _sample_after(len(modes)) and results[-1]["status"] == "ok":
            samples.append(host_sample(world, modes, args))  # the last: in predicted
    measured = results
    if a.repeat > 1:  # one column per mode (and cap), its runs pooled
        columns: dict[str, list[dict]] = {}
        for res in results:
            columns.setdefault(res.get("label", res["mode"]), []).append(res)
        measured = [report.pool_runs(runs) for runs in columns.values()]
    if a.predict:  # from every run (compute_step pools the compute-only step's)
        measured = measured + predicted(a.predict, modes, results, args, world, samples)
    results = measured
    doc = {"env": env, "modes": results}
    print("\n".join(envinfo.header_lines(env)))
    print()
    print(report.table(doc))
    print("\nDefinitions:\n" + report.DEFINITIONS.rstrip())
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=2)
    if a.plot:
        from commlab.measure.plots import plot_compare

        plot_compare(doc, a.plot)
    return 0 if any(m["status"] == "ok" for m in results) else 1


if __name__ == "__main__":
    sys.exit(main())
