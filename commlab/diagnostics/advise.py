"""The seed article's DP/DDP decision tree, with the reason for every rule that fires.

    python -m commlab.advise --gpus 4 --nodes 1 --amp
    python -m commlab.advise --gpus 2 --batch-size 64 --iter-ms 80
    python -m commlab.advise --from compare.json       # measured numbers replace rules of thumb

The rules (seed, section 5): more than one node -> DDP required; >= 4 GPUs on a node
-> DDP strongly recommended; model memory above half a card -> DDP required; mixed
precision -> DDP recommended; small experiments (2-3 GPUs, per-card batch <= 32,
iteration < 100 ms, no custom C++ extensions) -> DataParallel acceptable.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Finding:
    verdict: str  # "DDP required" | "DDP strongly recommended" | "DDP recommended" | "DP acceptable" | ...
    rule: str
    reason: str


_RANK = {"DDP required": 4, "DDP strongly recommended": 3, "DDP recommended": 2, "DP acceptable": 1}


def decide(gpus: int, nodes: int = 1, model_mem_frac: float | None = None, amp: bool = False,
           batch_size: int | None = None, iter_ms: float | None = None, custom_cpp: bool = False) -> tuple[str, list[Finding]]:
    """(overall verdict, every rule that fired). batch_size is the global batch."""
    if gpus < 1 or nodes < 1:
        raise ValueError("gpus and nodes must be >= 1")
    out: list[Finding] = []
    if nodes > 1:
        out.append(Finding("DDP required", "nodes > 1",
                           f"{nodes} nodes: DataParallel is one process on one machine and cannot span nodes"))
    if gpus >= 4:
        out.append(Finding("DDP strongly recommended", "GPUs per node >= 4",
                           f"{gpus} GPUs: DP's GPU 0 gathers every output and gradient, so its traffic grows "
                           f"as 2(p-1)·n while ring all-reduce stays at 2(p-1)/p·n per GPU"))
    if model_mem_frac is not None and model_mem_frac > 0.5:
        out.append(Finding("DDP required", "model memory > 50% of a card",
                           f"the model takes {model_mem_frac:.0%} of a card; DP replicates it every iteration "
                           f"and piles outputs and gradients on GPU 0, which then runs out of memory first"))
    if amp:
        out.append(Finding("DDP recommended", "mixed precision",
                           "autocast and GradScaler are per-process state; DP's replica threads make them fragile"))
    per_card = None if batch_size is None else batch_size / gpus
    small = (2 <= gpus <= 3 and nodes == 1 and (per_card is None or per_card <= 32)
             and (iter_ms is None or iter_ms < 100) and not custom_cpp
             and not (model_mem_frac is not None and model_mem_frac > 0.5))
    if small and not out:
        unknown = [n for n, v in (("per-card batch", per_card), ("iteration time", iter_ms)) if v is None]
        out.append(Finding("DP acceptable", "small experiment",
                           f"{gpus} GPUs on one node" + (f", per-card batch {per_card:g} <= 32" if per_card is not None else "")
                           + (f", iteration {iter_ms:g} ms < 100 ms" if iter_ms is not None else "")
                           + ", no custom C++ extensions: DataParallel's one-line setup is a fair trade"
                           + (f" (not given, assumed small: {', '.join(unknown)})" if unknown else "")))
    if not out:
        reasons = []
        if gpus == 1:
            reasons.append("one GPU: neither is needed; DDP with one process keeps the code ready to scale")
        if per_card is not None and per_card > 32:
            reasons.append(f"per-card batch {per_card:g} > 32")
        if iter_ms is not None and iter_ms >= 100:
            reasons.append(f"iteration {iter_ms:g} ms >= 100 ms")
        if custom_cpp:
            reasons.append("custom C++ extensions (often not thread-safe under DP's replica threads)")
        out.append(Finding("DDP recommended", "outside the small-experiment case", "; ".join(reasons) or "default"))
    verdict = max(out, key=lambda f: _RANK.get(f.verdict, 0)).verdict
    return verdict, out


def from_compare(doc: dict) -> list[str]:
    """Measured evidence from a commlab.compare --json run."""
    modes = {m["mode"]: m for m in doc.get("modes", [])}
    ok = {k: m for k, m in modes.items() if m.get("status") == "ok"}
    lines = []
    for k, m in modes.items():
        if m.get("status") != "ok":
            lines.append(f"{k}: {m.get('status')} ({m.get('reason', '')})")
    if not ok:
        return lines + ["no mode ran successfully: nothing measured to decide on"]
    fastest = min(ok, key=lambda k: ok[k]["iter_ms"]["median"])
    lines.append(f"fastest: {fastest} at {ok[fastest]['iter_ms']['median']:.1f} ms per iteration")
    for k, m in sorted(ok.items(), key=lambda kv: kv[1]["iter_ms"]["median"]):
        if k == fastest:
            continue
        ratio = m["iter_ms"]["median"] / ok[fastest]["iter_ms"]["median"]
        lines.append(f"  {k}: {m['iter_ms']['median']:.1f} ms ({ratio:.2f}x slower)")
    if "dp" in ok and "ddp" in ok:
        dp, ddp = ok["dp"], ok["ddp"]
        speedup = dp["iter_ms"]["median"] / ddp["iter_ms"]["median"]
        verdict = "DDP" if speedup > 1.05 else ("DP" if speedup < 0.95 else "either (within 5%)")
        lines.append(f"measured: DDP is {speedup:.2f}x DP's speed -> {verdict}")
        dpm, ddpm = max(dp.get("peak_memory_mb") or [0]), max(ddp.get("peak_memory_mb") or [0])
        if dpm and ddpm:
            lines.append(f"peak memory on the busiest device: DP {dpm:.0f} MB vs DDP {ddpm:.0f} MB "
                         f"({dpm - ddpm:+.0f} MB for DP's main card)")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m commlab.advise", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, help="GPUs per node")
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--model-mem-frac", type=float, help="model memory (params + grads + optimizer) / one card's memory")
    ap.add_argument("--amp", action="store_true", help="mixed-precision training")
    ap.add_argument("--batch-size", type=int, help="global batch size")
    ap.add_argument("--iter-ms", type=float, help="time of one training iteration")
    ap.add_argument("--custom-cpp", action="store_true", help="the model uses custom C++/CUDA extensions")
    ap.add_argument("--from", dest="source", help="a commlab.compare --json result: decide on measurements")
    args = ap.parse_args(argv)
    if args.source:
        with open(args.source) as f:
            doc = json.load(f)
        print("# measured (commlab.compare):")
        for line in from_compare(doc):
            print("  " + line)
        if args.gpus is None:
            return 0
    if args.gpus is None:
        ap.error("--gpus is required (or --from)")
    verdict, findings = decide(args.gpus, args.nodes, args.model_mem_frac, args.amp, args.batch_size, args.iter_ms,
                               args.custom_cpp)
    print(f"# rules of thumb (seed article): {verdict}")
    for f in findings:
        print(f"  [{f.verdict}] {f.rule}: {f.reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
