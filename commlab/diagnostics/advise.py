"""The seed article's DP/DDP decision tree, with the reason for every rule that fires.

    python -m commlab.advise --gpus 4 --nodes 1 --amp
    python -m commlab.advise --gpus 2 --batch-size 64 --iter-ms 80
    python -m commlab.advise --from compare.json       # measured numbers replace rules of thumb
    python -m commlab.advise --hardware rtx4090-pcie4 --gpus 4 --model transformer --width 2048 --depth 24
                                                       # DDP, ZeRO-1/2 or FSDP, on predicted numbers

The rules (seed, section 5): more than one node -> DDP required; >= 4 GPUs on a node
-> DDP strongly recommended; model memory above half a card -> DDP required; mixed
precision -> DDP recommended; small experiments (2-3 GPUs, per-card batch <= 32,
iteration < 100 ms, no custom C++ extensions) -> DataParallel acceptable.

The question as it is asked today, DDP or ZeRO-1/2 or FSDP (ZeRO-3), is decided on
numbers, predicted for a hardware profile (--hardware) or measured (--from a compare run
of those modes): the fastest mode whose memory fits a device, with the reason each
other mode loses — DDP no longer fits, ZeRO-1/2 is enough, FSDP's second all-gather
costs more than the memory it saves.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, replace

from commlab.core.cli import run
from commlab.experiments.predict import per_mode, replicated
from commlab.experiments.predict.hardware import load_profile


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


SHARDING = {"ddp": "DDP", "zero1": "ZeRO-1 (DDP + ZeroRedundancyOptimizer)",
            "fsdp:noreshard": "FSDP without resharding (ZeRO-2-like)", "fsdp": "FSDP (ZeRO-3)"}


def _memory_mb(m: dict) -> float:
    """A device's memory: the predicted or measured GPU peak; on CPU the tensor bytes
    (the process RSS hides sharding under the interpreter)."""
    peaks = [x for x in m.get("peak_memory_mb") or [] if x is not None]
    return max(peaks) if peaks and m.get("device", "cuda") == "cuda" else m.get("tensor_mb") or 0.0


def sharding(rows: list[dict], limit_mb: float | None, device: str = "cuda") -> tuple[str, list[Finding]]:
    """(the mode to use, every reason) from rows of ddp, zero1, fsdp:noreshard and fsdp
    (commlab.predict's or commlab.compare's): the fastest that fits limit_mb per device
    (None: memory does not decide)."""
    ok = {m["mode"]: dict(m, device=device) for m in rows if m.get("status") == "ok" and m["mode"] in SHARDING}
    if not ok:
        raise ValueError("no row of ddp, zero1, fsdp:noreshard or fsdp to decide on")
    mem = {k: _memory_mb(m) for k, m in ok.items()}
    ms = {k: m["iter_ms"]["median"] for k, m in ok.items()}
    fits = {k: limit_mb is None or mem[k] <= limit_mb for k in ok}
    unit = "MB of tensors" if device == "cpu" else "MB"
    out: list[Finding] = []
    cap = f" of {limit_mb:.0f} MB" if limit_mb else ""
    for k in ok:
        out.append(Finding("fits" if fits[k] else "does not fit", f"{k} memory",
                           f"{SHARDING[k]}: {mem[k]:.0f} {unit} per device{cap}, {ms[k]:.1f} ms per iteration, "
                           f"{ok[k].get('comm_mb') or 0:.0f} MB on the wire per step"))
    candidates = [k for k in ok if fits[k]]
    if not candidates:
        least = min(ok, key=mem.get)
        out.append(Finding("nothing fits", "every mode above the limit",
                           f"even {SHARDING[least]} needs {mem[least]:.0f} MB: shard over more devices, checkpoint "
                           f"activations, mixed precision or a smaller batch"))
        return "nothing fits", out
    best = min(candidates, key=ms.get)
    if "ddp" in ok and not fits["ddp"]:
        state = (ok["ddp"].get("tensor_breakdown_mb") or {}).get("optimizer_state", 0.0)
        out.append(Finding("DDP does not fit", "model + optimizer state above a device",
                           f"DDP holds every parameter, gradient, bucket copy and the optimizer state ({state:.0f} MB) "
                           f"on each device: {mem['ddp']:.0f} MB{cap}"))
        if "zero1" in ok and fits["zero1"]:
            extra = ms["zero1"] - ms["ddp"]
            out.append(Finding("ZeRO-1/2 is enough", "sharding the optimizer state brings it under",
                               f"{mem['zero1']:.0f} MB with the optimizer state divided over the devices, "
                               f"{extra:+.1f} ms per iteration against DDP for its parameter broadcasts"))
    if "fsdp" in ok and "fsdp:noreshard" in ok:
        saved, cost = mem["fsdp:noreshard"] - mem["fsdp"], ms["fsdp"] - ms["fsdp:noreshard"]
        if fits["fsdp:noreshard"] and cost > 0:
            out.append(Finding("reshard only if needed", "FSDP's second all-gather costs more than it saves",
                               f"resharding after forward saves {saved:.0f} MB per device but gathers every block "
                               f"again in backward ({ok['fsdp'].get('comm_mb', 0) - ok['fsdp:noreshard'].get('comm_mb', 0):.0f}"
                               f" MB more on the wire): {cost:+.1f} ms per iteration, and without it the step fits"))
        elif not fits["fsdp:noreshard"] and fits["fsdp"]:
            out.append(Finding("FSDP required", "only resharding fits",
                               f"keeping every block gathered needs {mem['fsdp:noreshard']:.0f} MB{cap}; resharding "
                               f"brings it to {mem['fsdp']:.0f} MB at {cost:+.1f} ms per iteration"))
    if "ddp" in ok and best != "ddp":
        gain = ms["ddp"] / ms[best]
        reasons = []
        opt_b, opt_d = ((ok[k].get("breakdown") or {}).get("optimizer_ms") for k in (best, "ddp"))
        if opt_b is not None and opt_d is not None and opt_b < opt_d:
            reasons.append(f"its optimizer step {opt_b:.1f} ms against DDP's {opt_d:.1f} (the state sharded)")
        exp_b, exp_d = ((ok[k].get("grad_sync_ms") or {}).get("exposed") for k in (best, "ddp"))
        if exp_b is not None and exp_d is not None and exp_b < exp_d:
            reasons.append(f"{exp_b:.1f} ms of synchronisation exposed against DDP's {exp_d:.1f}")
        if not fits["ddp"]:
            reasons.append("DDP does not fit")
        why = "; ".join(reasons)
        out.append(Finding(SHARDING[best], "the fastest that fits",
                           f"{ms[best]:.1f} ms per iteration, {gain:.2f}x DDP's speed" + (f": {why}" if why else "")))
    else:
        slower = {k: ms[k] - ms[best] for k in candidates if k != best}
        out.append(Finding(SHARDING[best], "the fastest that fits",
                           f"{ms[best]:.1f} ms per iteration; sharding adds " +
                           ", ".join(f"{SHARDING[k]} {v:+.1f} ms" for k, v in slower.items()) +
                           " (more bytes on the wire, the same compute)" if slower else f"{ms[best]:.1f} ms"))
    return SHARDING[best], out


def _flags(checkpoint: bool, accum: int) -> str:
    return " ".join(f for f, on in (("--checkpoint", checkpoint), (f"--accum-steps {accum}", accum > 1)) if on)


def remedies(s, prof, limit_mb: float, device: str, modes: list[str] | None = None) -> list[dict]:
    """The same global batch made to fit by what changes no result (up to rounding):
    activations recomputed in backward (--checkpoint) and the batch split into micro-steps
    (--accum-steps, powers of two down to one sample per device). Per option, each mode
    (default: all four) predicted: {"flags", "mode", "ms", "mb", "fits", "micro"}."""


    per_device = max(1, s.batch_size // s.world)
    out = []
    for checkpoint in (False, True):
        steps = None
        accum = 1
        while accum <= per_device:
            if checkpoint or accum > 1:
                option = replace(s, checkpoint=checkpoint, accum_steps=accum)
                steps = steps or replicated.Steps(replace(option, accum_steps=1))  # traced once; micro-steps extrapolated
                for r in per_mode.predict(modes or list(SHARDING), option, prof, steps):
                    if r.get("status") == "ok":
                        mb = _memory_mb(dict(r, device=device))
                        out.append({"flags": _flags(checkpoint, accum), "mode": r["mode"], "ms": r["iter_ms"]["median"],
                                    "mb": mb, "fits": mb <= limit_mb, "micro": option.micro_batch()})
            accum *= 2
    return out


def predicted_sharding(hardware: str, gpus: int, model: str, batch_size: int, width: int = 1024, depth: int = 4,
                       amp: str | None = None, mem_limit_mb: float | None = None) -> tuple[str, list[Finding], list]:

    prof = load_profile(hardware)
    s = replicated.Setup(model=model, world=gpus, batch_size=batch_size, amp=amp, width=width, depth=depth,
                         optimizer="adamw")
    rows = per_mode.predict(list(SHARDING), s, prof)
    limit = mem_limit_mb or (prof.memory_bytes / 2**20 if prof.device == "cuda" else None)
    verdict, findings = sharding(rows, limit, prof.device)
    ok = [r for r in rows if r.get("status") == "ok"]
    fits = {r["mode"]: limit is None or _memory_mb(dict(r, device=prof.device)) <= limit for r in ok}
    if all(fits.values()):
        return verdict, findings, rows
    # Some mode does not fit as asked: would checkpointing or accumulation make a faster one fit?
    plain = min((r["iter_ms"]["median"] for r in ok if fits[r["mode"]]), default=None)
    # Both shrink activations only (accumulation grows FSDP's held gradients) and neither
    # makes a mode faster than it is as asked: only modes whose tensors fit and that would
    # beat what already fits are worth predicting again (a 1.3 B model's DDP on a 4090 is not).
    worth = [r["mode"] for r in ok if (r.get("tensor_mb") or 0.0) <= limit
             and (plain is None or r["iter_ms"]["median"] < plain)]
    if not worth:
        if verdict == "nothing fits":
            least = min(ok, key=lambda r: r.get("tensor_mb") or 0.0)
            findings.append(Finding("nothing fits", "not even recomputed and accumulated",
                                    f"{SHARDING[least['mode']]}'s parameters, gradients and optimizer state alone are "
                                    f"{least.get('tensor_mb') or 0.0:.0f} MB of {limit:.0f}, which neither shrinks: "
                                    f"shard over more devices or train in lower precision"))
        return verdict, findings, rows
    options = remedies(s, prof, limit, prof.device, worth)
    fitting = [o for o in options if o["fits"]]
    if not fitting:
        if verdict == "nothing fits":
            least = min(options, key=lambda o: o["mb"], default=None)
            if least:
                findings.append(Finding("nothing fits", "not even recomputed and accumulated",
                                        f"the least is {SHARDING[least['mode']]} with {least['flags']} (micro-batch "
                                        f"{least['micro']} per device): {least['mb']:.0f} MB of {limit:.0f}: shard over "
                                        f"more devices or train in lower precision"))
        return verdict, findings, rows
    best = min(fitting, key=lambda o: o["ms"])
    if plain is None or best["ms"] < plain:
        then = (f"against {plain:.1f} ms for {verdict} as asked" if plain is not None
                else "where nothing fits as asked")
        findings.append(Finding(f"{SHARDING[best['mode']]} with {best['flags']}",
                                "recomputed or accumulated, the same global batch, faster",
                                f"{best['mb']:.0f} MB per device of {limit:.0f} (micro-batch {best['micro']} per "
                                f"device), {best['ms']:.1f} ms per iteration, {then}"))
        verdict = f"{SHARDING[best['mode']]} with {best['flags']}"
    return verdict, findings, rows


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
    ap.add_argument("--hardware", help="a commlab.predict profile: DDP vs ZeRO-1/2 vs FSDP predicted on it (with "
                    "--gpus, --model, --width, --depth, --batch-size; AdamW)")
    ap.add_argument("--model", default="transformer")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--mem-limit-mb", type=float, help="memory per device (default: the profile's; measured CPU runs: "
                    "none, memory does not decide)")
    args = ap.parse_args(argv)
    if args.source:
        with open(args.source) as f:
            doc = json.load(f)
        print("# measured (commlab.compare):")
        for line in from_compare(doc):
            print("  " + line)
        if any(m.get("mode") in SHARDING and m["mode"] != "ddp" for m in doc.get("modes", [])):
            measured = [m for m in doc["modes"] if not m.get("predicted")]
            verdict, findings = sharding(measured, args.mem_limit_mb, doc.get("env", {}).get("device", "cuda"))
            _print_sharding("measured", verdict, findings)
        if args.gpus is None:
            return 0
    if args.hardware:
        if args.gpus is None:
            ap.error("--hardware needs --gpus")
        try:
            verdict, findings, _ = predicted_sharding(args.hardware, args.gpus, args.model,
                                                      args.batch_size or 8 * args.gpus, args.width, args.depth,
                                                      "bf16" if args.amp else None, args.mem_limit_mb)
        except ValueError as e:
            ap.error(str(e))
        _print_sharding(f"predicted on {args.hardware}", verdict, findings)
    if args.gpus is None:
        ap.error("--gpus is required (or --from)")
    verdict, findings = decide(args.gpus, args.nodes, args.model_mem_frac, args.amp, args.batch_size, args.iter_ms,
                               args.custom_cpp)
    print(f"# rules of thumb (seed article): {verdict}")
    for f in findings:
        print(f"  [{f.verdict}] {f.rule}: {f.reason}")
    return 0


def _print_sharding(what: str, verdict: str, findings: list[Finding]) -> None:
    print(f"# DDP, ZeRO-1/2 or FSDP ({what}): {verdict}")
    for f in findings:
        print(f"  [{f.verdict}] {f.rule}: {f.reason}")


if __name__ == "__main__":
    run(main)
