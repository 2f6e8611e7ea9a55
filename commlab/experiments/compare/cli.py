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
import json
import os
import re
import sys

import torch

from commlab.core.cli import run
from commlab.experiments import workloads
from commlab.experiments.compare import report, search
from commlab.experiments.compare.calibrate import host_sample, predicted, sample_after
from commlab.experiments.compare.modes import all_modes, default_modes, run_mode
from commlab.experiments.modes import Mode
from commlab.measure import envinfo, pools, trace
from commlab.measure.launch import check_gpus_per_rank
from commlab.measure.plots import plot_compare, plot_trace


def write_trace(records: list[dict], label: str, directory: str) -> dict:
    """One mode's trace as DIR/<label>.json and, with matplotlib, DIR/<label>.png; the
    row keeps the paths and the sync figures read back from the trace."""
    os.makedirs(directory, exist_ok=True)
    name = re.sub(r"[^\w.:-]+", "_", label)
    doc = trace.chrome_trace(records, label)
    out = {"json": os.path.join(directory, name + ".json"), "sync_ms": trace.sync_ms(doc)}
    trace.write(doc, out["json"])
    try:

        plot_trace(doc, os.path.join(directory, name + ".png"))
        out["png"] = os.path.join(directory, name + ".png")
    except SystemExit as e:  # no matplotlib: the JSON alone, and why
        out["png_skipped"] = str(e)
    return out


def _parser() -> argparse.ArgumentParser:
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
    return ap


def _settle(ap: argparse.ArgumentParser, a: argparse.Namespace) -> tuple[dict, list[float], list[str], int]:
    """Every refusal before a rank starts; the arguments each mode gets, the bucket caps, the
    modes in the order they run (--repeat's rounds, this-host's compute-only runs) and the
    world size."""
    args = vars(a)
    if a.device == "cuda" and a.warmup < 1:
        ap.error("--device cuda needs --warmup 1 or more: the last warm-up step is profiled for the collectives' "
                 "device time (NCCL completes a collective's future at launch; FSDP2 runs them on its own streams)")
    try:
        caps = [float(c) for c in str(a.bucket_cap_mb).split(",") if c.strip()]
    except ValueError:
        ap.error(f"--bucket-cap-mb takes numbers, comma-separated for a sweep: {a.bucket_cap_mb!r}")
    if not caps or min(caps) <= 0:
        ap.error("--bucket-cap-mb must be positive")
    args["bucket_cap_mb"] = caps[0]
    modes = all_modes(a.device) if a.modes == "all" else (a.modes.split(",") if a.modes else default_modes(a.device))
    any_sharded = any(Mode.parse(m).sharded for m in modes)
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
    return args, caps, modes, world


def _environment(a: argparse.Namespace, args: dict, caps: list[float], world: int) -> dict:
    env = envinfo.collect(torch.device("cpu"))
    env.update(world_size=world, device=a.device, model=args["model"], batch_size=a.batch_size,
               bucket_cap_mb=caps if len(caps) > 1 else caps[0], mem_limit_mb=a.mem_limit_mb, amp=a.amp,
               checkpoint=a.checkpoint, accum_steps=a.accum_steps, share_gpu=a.share_gpu, optimizer=args["optimizer"],
               **({"repeat": a.repeat} if a.repeat > 1 else {}))
    if a.share_gpu:
        env["note"] = "--share-gpu: all DDP ranks on one GPU over gloo, a functional check, not a speed figure"
    return env


def _run_modes(a: argparse.Namespace, args: dict, caps: list[float], modes: list[str],
               world: int) -> tuple[list[dict], list]:
    """Each mode (and bucket cap) in fresh ranks, in order; this-host's calibration samples
    taken between them."""
    results, samples = [], []
    for n, mode in enumerate(modes):
        m = Mode.parse(mode)
        # bucket_cap_mb shapes DDP's gradient buckets: swept for the modes that communicate.
        swept = m.kind == "ddp" and not m.noop
        for cap in (caps if swept else caps[:1]):
            margs = dict(args, bucket_cap_mb=cap)
            label = f"{mode} @{cap:g}MB" if len(caps) > 1 and swept else mode
            if a.repeat == 1 and modes.count(mode) > 1:  # this-host's compute-only step, run first and last
                label = f"{mode} ({'first' if n == modes.index(mode) else 'last'})"
            run = modes[:n].count(mode) + 1  # which of this mode's runs (--repeat)
            print(f"# running {label}" + (f" (run {run} of {modes.count(mode)})" if a.repeat > 1 else "") + " ...",
                  file=sys.stderr, flush=True)
            res = run_mode(mode, world, margs)
            if m.kind == "ddp":
                res["bucket_cap_mb"] = cap
            if label != mode:
                res["label"] = label
            records = res.pop("trace_records", None)
            if a.trace and records:
                res["trace"] = write_trace(records, label + (f" run {run}" if a.repeat > 1 else ""), a.trace)
            if a.find_max_batch and res["status"] in ("ok", "oom") and run == 1:
                res["max_batch"], res["max_batch_probes"] = search.find_max_batch(mode, world, margs, run_mode)
            results.append(res)
        if a.predict == "this-host" and n in sample_after(len(modes)) and results[-1]["status"] == "ok":
            samples.append(host_sample(world, modes, args))  # the last: in predicted
    return results, samples


def _columns(a: argparse.Namespace, args: dict, modes: list[str], world: int, results: list[dict],
             samples: list) -> list[dict]:
    """The table's columns: one per mode (its runs pooled with --repeat), then the predicted ones."""
    measured = results
    if a.repeat > 1:  # one column per mode (and cap), its runs pooled
        columns: dict[str, list[dict]] = {}
        for res in results:
            columns.setdefault(res.get("label", res["mode"]), []).append(res)
        measured = [report.pool_runs(runs) for runs in columns.values()]
    if a.predict:  # from every run (compute_step pools the compute-only step's)
        measured = measured + predicted(a.predict, modes, results, args, world, samples)
    return measured


def main(argv=None) -> int:
    ap = _parser()
    a = ap.parse_args(argv)
    args, caps, modes, world = _settle(ap, a)
    pools.preload("torch._dynamo")  # every DDP constructor imports it: once in the ranks' server, not in each rank
    env = _environment(a, args, caps, world)
    results = _columns(a, args, modes, world, *_run_modes(a, args, caps, modes, world))
    doc = {"env": env, "modes": results}
    print("\n".join(envinfo.header_lines(env)))
    print()
    print(report.table(doc))
    print("\nDefinitions:\n" + report.DEFINITIONS.rstrip())
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=2)
    if a.plot:
        plot_compare(doc, a.plot)
    return 0 if any(m["status"] == "ok" for m in results) else 1


if __name__ == "__main__":
    run(main)
