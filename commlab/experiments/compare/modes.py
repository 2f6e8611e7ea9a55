"""compare's modes: the catalogue (DataParallel, DDP over each all-reduce, the sharded
modes, the backend's), and running one mode's ranks with its failures reported."""
from __future__ import annotations

import torch

from commlab import algorithms
from commlab.experiments.compare import report, sharded, workers
from commlab.experiments.modes import Mode
from commlab.measure import pools, trace
from commlab.training import fsdp


def default_modes(device: str) -> list[str]:
    wanted = ["dp", "ddp", "ddp:ring", "ddp:ps", "ddp:shm", "ddp:noop"] + _backend_modes(device)
    return [m for m in wanted if Mode.parse(m).algorithm in (None, *algorithms.for_device(device))]


def all_modes(device: str) -> list[str]:
    return ["dp", "ddp"] + [f"ddp:{a}" for a in algorithms.for_device(device)] + ["ddp:noop"] + _backend_modes(device) \
        + _sharded_modes(device)


def _sharded_modes(device: str) -> list[str]:
    """ZeRO-1 and FSDP2; FSDP's collectives through commlab on CPU only (its algorithms
    serve FSDP2 there; on a GPU FSDP2 waits on torch's Work, which commlab's handle is not)."""
    return ["zero1", "fsdp", "fsdp:noreshard"] + ([f"fsdp:{a}" for a in fsdp.algorithms()] if device == "cpu" else [])


def sharded_refusal(args: dict) -> str | None:
    """Why a sharded mode cannot run on this GPU setup, or None."""
    if args["device"] == "cuda" and args["share_gpu"]:
        return "the sharded modes run over NCCL with a GPU per rank; --share-gpu runs gloo, whose CUDA " \
               "collectives FSDP2 does not use"
    return None


def _backend_modes(device: str) -> list[str]:
    """DDP's default reduction with the process group on commlab's backend (CPU tensors)."""
    return ["ddp@commlab"] if device == "cpu" else []


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
    iters = report.iteration_summary(res[0].times)
    exposed = max(r.sync_exposed for r in res)
    # The part of it after the last rank arrived: communication, not waiting for a slower rank.
    split = trace.exposed_split([r.trace for r in res]) if res[0].trace else {}
    after = split.get("after_arrival")
    se = report.standard_error(split.get("exposed_per_iteration") or [])  # how much it moves step to step
    first = res[0]
    return {
        "mode": mode, "status": "ok", "reason": "",
        "iter_ms": iters,
        "iteration_ms": [t * 1e3 for t in first.times],  # every timed step, the slowest rank's
        "samples_per_s": args["batch_size"] / (iters["median"] / 1e3),
        "peak_memory_mb": [r.memory_mb for r in res],
        "util_percent": [r.util for r in res],
        "grad_sync_ms": {"total": max(r.sync_total for r in res), "exposed": exposed,
                         "after_arrival": after if after is not None else (0.0 if exposed == 0 else None),
                         **({"exposed_se": se} if se is not None else {})},
        "final_loss": first.loss,
        # ddp:noop: what this-host's wait for the last rank is predicted from, per timed iteration.
        **({"arrival_skew_ms": first.arrival_skew_ms, "backward_end_ms": first.backward_end_ms,
            "unit_waits_ms": first.unit_waits_ms, "wait_se_ms": first.wait_se_ms}
           if first.unit_waits_ms is not None else {}),  # DDP's skew needs a step before: may be None
        **({"optimizer_ms": max(r.optimizer_ms for r in res)} if first.optimizer_ms is not None else {}),
        **({"tensor_mb": max(r.tensor_mb for r in res),
            "tensor_breakdown_mb": max(res, key=lambda r: r.tensor_mb).tensor_breakdown_mb}
           if first.tensor_mb is not None else {}),
        "comm_mb": max(r.comm_bytes for r in res) / 2**20,
        **({"params": first.params} if first.params is not None else {}),
        **({"trace_records": [r.trace for r in res]} if args.get("trace") and first.trace else {}),
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
    m = Mode.parse(mode)
    if m.kind == "dp":
        return run_dp_mode(args)
    if m.kind == "ddp" and (m.algorithm in (None, *algorithms.for_device(device))) \
            and (not m.backend or mode in _backend_modes(device)):
        return run_ddp_mode(mode, world, args)
    if mode in _sharded_modes(device):
        refusal = sharded_refusal(args)
        if refusal:
            return {"mode": mode, "status": "unavailable", "reason": refusal}
        return run_ddp_mode(mode, world, args, sharded.sharded_rank)
    return {"mode": mode, "status": "unavailable",
            "reason": f"no such mode for {device} (modes: {', '.join(all_modes(device))})"}
