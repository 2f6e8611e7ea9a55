"""What-if: the seed's DP vs DDP table predicted for hardware you do not have.

    python -m commlab.predict --hardware rtx4090-pcie4 --gpus 4 --model resnet50 --batch-size 256
    python -m commlab.predict --hardware a100-sxm-nvlink --gpus 8 --model resnet50 --batch-size 1024 --amp bf16
    python -m commlab.predict --hardware rtx4090-pcie4 --gpus 4 --model resnet50 --batch-size 256 --find-max-batch

Compute: every operation of one training step, traced on meta tensors (FLOPs by
torch.utils.flop_counter, bytes read and written), timed at the larger of FLOPs at the
profile's datasheet peak and bytes at its memory bandwidth: a roofline, so a lower
bound on compute. Communication: DDP's buckets (reverse parameter order, 1 MiB first,
then --bucket-cap-mb) all-reduced with the algorithm's α-β-γ cost on the profile's
link as their gradients become ready, overlapped with the rest of backward; DP's
scatter, parameter broadcast, output gather and gradient reduce through device 0's
one link, none of it hidden. Memory per device (what max_memory_allocated counts): the
weights, the step's peak of everything else alive at once (tracked through the trace),
the input, DDP's bucket copies, and DP's extras on device 0. Profiles are data files with their sources:
commlab/experiments/predict/profiles/.
"""
from __future__ import annotations

import argparse
import json

from commlab.core.cli import run
from commlab.experiments import workloads
from commlab.experiments.compare import report
from commlab.experiments.modes import Mode
from commlab.experiments.predict import hardware, per_mode, replicated

NOT_MODELLED = ("not modelled: kernel launch and Python overhead (DP's replica threads share one interpreter), "
                "kernels below the roofline, the allocator's cache and cuDNN workspaces, data loading")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m commlab.predict", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hardware", required=True, help=f"a profile ({', '.join(hardware.profile_names())}) or a profile file")
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--model", default="resnet50", help="mlp | transformer | any torchvision model | "
                    "package.module:factory (a callable returning the module, or (module, example input batch))")
    ap.add_argument("--input-shape", help="one sample's shape for a factory model, e.g. 3,224,224")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=256, help="global batch")
    ap.add_argument("--bucket-cap-mb", type=float, default=None,
                    help="what DDP is given (its first bucket that size too, as torch makes it); default: DDP's own, "
                         "25 MiB after a 1 MiB first bucket")
    ap.add_argument("--amp", choices=["fp16", "bf16"], default=None)
    ap.add_argument("--checkpoint", action="store_true")
    ap.add_argument("--accum-steps", type=int, default=1,
                    help="micro-steps per optimizer step, each of batch / gpus / accum-steps (compare's)")
    ap.add_argument("--modes", default="dp,ddp,ddp:noop",
                    help="comma list: dp, ddp, ddp:<algorithm>, ddp:noop, zero1, fsdp, fsdp:noreshard, fsdp:<algorithm>")
    ap.add_argument("--optimizer", choices=["sgd", "adamw"], default=None,
                    help="default: adamw when a sharded mode (zero1, fsdp*) is asked for, as compare's; else sgd")
    ap.add_argument("--find-max-batch", action="store_true", help="the largest global batch that fits each device")
    ap.add_argument("--mem-limit-mb", type=float, help="device memory for --find-max-batch (default: the profile's)")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    try:
        prof = hardware.load_profile(a.hardware)
    except ValueError as e:
        ap.error(str(e))
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    optimizer = a.optimizer or ("adamw" if any(Mode.parse(m).sharded for m in modes) else "sgd")
    given = a.bucket_cap_mb is not None
    a.bucket_cap_mb = a.bucket_cap_mb if given else replicated.Setup.bucket_cap_mb
    s = replicated.Setup(model=a.model, world=a.gpus, batch_size=a.batch_size, bucket_cap_mb=a.bucket_cap_mb,
                         bucket_cap_given=given, amp=a.amp,
                         checkpoint=a.checkpoint, width=a.width, depth=a.depth, optimizer=optimizer, accum_steps=a.accum_steps)
    if a.accum_steps < 1:
        ap.error("--accum-steps must be at least 1")
    try:
        s.input_shape = workloads.parse_shape(a.input_shape)
        steps = replicated.Steps(s)
    except ValueError as e:
        ap.error(str(e))
    rows = per_mode.predict(modes, s, prof, steps)
    if a.find_max_batch:
        limit = (a.mem_limit_mb * 2**20) if a.mem_limit_mb else prof.memory_bytes
        for r in rows:
            if r["status"] == "ok":
                r["max_batch"] = per_mode.max_batch(r["mode"], s, prof, steps, limit)
    env = {"predicted": True, "hardware": prof.name, "profile": prof.description, "device": prof.device,
           "world_size": a.gpus, "model": a.model, "batch_size": a.batch_size, "bucket_cap_mb": a.bucket_cap_mb,
           "amp": a.amp, "checkpoint": a.checkpoint, "optimizer": optimizer, "accum_steps": a.accum_steps}
    doc = {"env": env, "modes": rows, "predicted": True, "sources": prof.sources}
    for k, v in env.items():
        print(f"# {k}: {v}")
    print()
    print(report.table(doc))
    for r in rows:
        if r["status"] == "ok":
            print(f"# {r['mode']}: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                                 for k, v in r["breakdown"].items()))
    print("# " + NOT_MODELLED)
    for x in prof.sources:
        print(f"# source: {x['source']}" + (f" <{x['url']}>" if x.get("url") else "") + f" -- {x['what'][:90]}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=2)
    return 0


if __name__ == "__main__":
    run(main)
