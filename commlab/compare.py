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
`ddp:noop` (no communication: the compute-only floor). Every mode trains the same model
from the same seed on the same synthetic data.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import queue
import resource
import statistics
import sys
import time
import traceback

import torch

from . import algorithms

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
               completion (the part that is not hidden behind backward). DP: one extra
               iteration under torch.profiler, the busiest GPU's time in NCCL kernels
               and peer copies (replicate, gradient reduce-add, scatter, gather); all
               of it exposed, as DP communicates on the compute stream
  final loss   mean over ranks of the last step's loss
"""

UTILIZATION_ROW = {"cpu": "utilization (%): CPU time / wall, per rank",
                   "cuda": "utilization (%): NVML GPU busy, per device"}


def default_modes(device: str) -> list[str]:
    wanted = ["dp", "ddp", "ddp:ring", "ddp:ps", "ddp:shm", "ddp:noop"]
    return [m for m in wanted if not m.startswith("ddp:") or m == "ddp:noop" or m[4:] in algorithms.for_device(device)]


def all_modes(device: str) -> list[str]:
    return ["dp", "ddp"] + [f"ddp:{a}" for a in algorithms.for_device(device)] + ["ddp:noop"]


# -- one DDP rank ---------------------------------------------------------------------------------
def _timing_hook(state, bucket):
    """DDP's own default reduction (divide, dist.all_reduce), timed like commlab's hooks."""
    import torch.distributed as dist

    buf = bucket.buffer()
    t0 = time.perf_counter()
    it = state.begin(bucket, t0)
    buf.div_(dist.get_world_size())
    fut = dist.all_reduce(buf, async_op=True).get_future()

    def done(f):
        state.end(it, t0, time.perf_counter())
        return f.value()[0]

    return fut.then(done)


class _NativeStats:
    """Statistics for the `ddp` mode shaped like commlab.hooks.CommState.stats()."""

    def __init__(self):
        self.reset_stats()

    def reset_stats(self):
        self.iters, self.cur = [], None

    def begin(self, bucket, t0):
        if self.cur is None:
            self.cur = {"comm": 0.0, "pending": 0, "end": None, "last": None}
        it = self.cur
        it["pending"] += 1
        if bucket.is_last():
            it["end"] = t0
            self.cur = None
        return it

    def end(self, it, t0, t1):
        it["comm"] += t1 - t0
        it["pending"] -= 1
        if it["pending"] == 0 and it["end"] is not None:
            it["last"] = t1
            self.iters.append(it)

    def stats(self):
        done = [i for i in self.iters if i["last"] is not None]
        n = len(done) or 1
        return {"mean_total_comm_ms": sum(i["comm"] for i in done) / n * 1e3,
                "mean_exposed_ms": sum(max(0.0, i["last"] - i["end"]) for i in done) / n * 1e3}


def _ddp_rank(rank: int, world: int, port: int, mode: str, args: dict, q) -> None:
    from . import launch

    try:
        result = _ddp_body(rank, world, port, mode, args)
        # The model, its reducer and hook state are gone with the body's frame: the group
        # can now be freed while the interpreter is alive.
        launch.leave()
        q.put((rank, "ok", result))
    except torch.OutOfMemoryError as e:
        q.put((rank, "oom", str(e).splitlines()[0]))
    except BaseException:  # noqa: BLE001 - reported in the table
        q.put((rank, "error", traceback.format_exc()))
    finally:
        launch.leave(together=False)  # after a failure: peers may be gone, do not wait for them


def _ddp_body(rank, world, port, mode, args):
    import datetime

    import psutil
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from . import hooks, workloads

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(args["threads"])
    cuda = args["device"] == "cuda"
    device = torch.device("cuda", rank % max(torch.cuda.device_count(), 1)) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    backend = "nccl" if cuda and not args["share_gpu"] else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args["timeout"]))
    if cuda and args["mem_limit_mb"]:
        _cap_gpu_memory(device, args["mem_limit_mb"])
    rss_before_model = psutil.Process().memory_info().rss
    torch.manual_seed(0)
    wl = workloads.build(args["model"], width=args["width"], depth=args["depth"])
    model = wl.model.to(device)
    if args["checkpoint"]:
        # Inside the module DDP wraps: calling the inner module directly would bypass
        # DDP's forward, and with it the gradient synchronisation.
        model = workloads.Checkpointed(model)
    ddp = DDP(model, device_ids=[device.index] if cuda else None, bucket_cap_mb=args["bucket_cap_mb"])
    if mode == "ddp":
        state = _NativeStats()
        ddp.register_comm_hook(state, _timing_hook)
    elif mode == "ddp:noop":
        state = None
        ddp.register_comm_hook(None, hooks.noop_hook)
    else:
        state = hooks.CommState(mode.split(":", 1)[1])
        hooks.register(ddp, state)
    opt = torch.optim.SGD(ddp.parameters(), lr=args["lr"])
    per_rank = max(args["batch_size"] // world, 1)
    accum = args["accum_steps"]
    micro = max(per_rank // accum, 1)
    scaler = torch.amp.GradScaler(device.type) if args["amp"] == "fp16" else None
    amp_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(args["amp"])
    proc = psutil.Process()

    def forward_loss(x, y):
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            return wl.loss(ddp(x).float(), y)

    def step(i):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for k in range(accum):
            x, y = wl.make_batch(micro, seed=(i * accum + k) * 1000 + rank)
            x, y = x.to(device), y.to(device)
            ctx = ddp.no_sync() if k < accum - 1 else contextlib.nullcontext()
            with ctx:
                loss = forward_loss(x, y) / accum
                (scaler.scale(loss) if scaler else loss).backward()
            total += float(loss.detach())
        _optimizer_step(opt, scaler)
        if cuda:
            torch.cuda.synchronize()
        return total

    for i in range(args["warmup"]):
        step(i)
    if state is not None:
        state.reset_stats()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    sampler = _NvmlSampler([device.index]) if cuda else None  # one metric per device type, as DP's
    if sampler is not None:
        sampler.start()
    cpu0, wall0 = sum(proc.cpu_times()[:2]), time.perf_counter()
    loss = 0.0
    for i in range(args["warmup"], args["warmup"] + args["iters"]):
        t0 = time.perf_counter()
        loss = step(i)
        times.append(time.perf_counter() - t0)
    if sampler is not None:
        util = (sampler.stop() or [None])[0]
    else:
        util = (sum(proc.cpu_times()[:2]) - cpu0) / (time.perf_counter() - wall0) * 100
    slowest = torch.tensor(times, dtype=torch.float64)
    mean_loss = torch.tensor([loss], dtype=torch.float64)
    if cuda and backend == "nccl":
        slowest, mean_loss = slowest.to(device), mean_loss.to(device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    dist.all_reduce(mean_loss)
    st = state.stats() if state is not None else {"mean_total_comm_ms": 0.0, "mean_exposed_ms": 0.0}
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB; the true peak, mid-step too
    mem = (torch.cuda.max_memory_allocated(device) if cuda else peak_rss) / 2**20
    if not cuda and args["mem_limit_mb"]:
        # CPU has no allocator limit: emulate one on what training added to the process,
        # agreed across ranks so they all stop together.
        over = torch.tensor([(peak_rss - rss_before_model) / 2**20], dtype=torch.float64)
        dist.all_reduce(over, op=dist.ReduceOp.MAX)
        if over.item() > args["mem_limit_mb"]:
            raise torch.OutOfMemoryError(f"emulated: a rank's training memory peaked at {over.item():.0f} MB, above "
                                         f"--mem-limit-mb {args['mem_limit_mb']:g}")
    if isinstance(state, hooks.CommState):
        state.close()
    return {"times": slowest.cpu().tolist(), "loss": float(mean_loss.item()) / world, "memory_mb": mem,
            "util": util, "sync_total": st["mean_total_comm_ms"], "sync_exposed": st["mean_exposed_ms"]}


def _cap_gpu_memory(device, limit_mb: float) -> None:
    """Make this process's caching allocator behave like a card of limit_mb (the seed's
    24 GB RTX 4090 on a bigger GPU): allocations beyond it raise OutOfMemoryError."""
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, limit_mb * 2**20 / total), device)


def _optimizer_step(opt, scaler) -> None:
    """One optimizer step, through the GradScaler when fp16 AMP uses one."""
    if scaler:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()


def _free_port() -> int:
    from .launch import free_port

    return free_port()


def run_ddp_mode(mode: str, world: int, args: dict) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_ddp_rank, args=(r, world, port, mode, args, q), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    got, deadline = {}, time.monotonic() + args["mode_timeout"]
    while len(got) < world and time.monotonic() < deadline:
        try:
            rank, status, payload = q.get(timeout=0.5)
            got[rank] = (status, payload)
        except queue.Empty:
            if not any(p.is_alive() for p in procs) and q.empty():
                break
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
    bad = {r: v for r, v in got.items() if v[0] != "ok"}
    if len(got) < world or bad:
        status = "oom" if any(v[0] == "oom" for v in bad.values()) else "error"
        missing = [r for r in range(world) if r not in got]
        reason = (f"ranks {missing} did not finish within {args['mode_timeout']:.0f}s; " if missing else "") + \
            "; ".join(f"rank {r}: {v[1].strip().splitlines()[-1]}" for r, v in sorted(bad.items()))
        return {"mode": mode, "status": status, "reason": reason}
    res = [got[r][1] for r in range(world)]
    times = sorted(res[0]["times"])
    median = statistics.median(times) * 1e3
    p90 = times[min(len(times) - 1, int(round(0.9 * (len(times) - 1))))] * 1e3
    return {
        "mode": mode, "status": "ok", "reason": "",
        "iter_ms": {"median": median, "p90": p90},
        "samples_per_s": args["batch_size"] / (median / 1e3),
        "peak_memory_mb": [r["memory_mb"] for r in res],
        "util_percent": [r["util"] for r in res],
        "grad_sync_ms": {"total": max(r["sync_total"] for r in res), "exposed": max(r["sync_exposed"] for r in res)},
        "final_loss": res[0]["loss"],
    }


def _is_ddp(mode: str) -> bool:
    return mode == "ddp" or mode.startswith("ddp:")


def run_mode(mode: str, world: int, args: dict) -> dict:
    device = args["device"]
    if mode == "dp":
        return run_dp_mode(args)
    if mode in ("ddp", "ddp:noop") or (mode.startswith("ddp:") and mode[4:] in algorithms.for_device(device)):
        return run_ddp_mode(mode, world, args)
    return {"mode": mode, "status": "unavailable",
            "reason": f"no such mode for {device} (modes: {', '.join(all_modes(device))})"}


def find_max_batch(mode: str, world: int, args: dict) -> tuple[int | None, list]:
    """The largest global batch (a multiple of the ranks/GPUs) that runs a short training
    without running out of memory: double from --batch-size until a run fails, then
    bisect between the last success and the first failure. Every probe runs in fresh
    processes, like the modes themselves. Returns (batch or None, [(batch, status)])."""
    unit = world if _is_ddp(mode) else (args["gpus"] or max(torch.cuda.device_count(), 1))
    probe_args = dict(args, warmup=1, iters=2)
    probes: list[tuple[int, str]] = []

    def runs(batch: int) -> bool | None:
        res = run_mode(mode, world, dict(probe_args, batch_size=batch))
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


def run_dp_mode(args: dict) -> dict:
    if args["device"] != "cuda" or not torch.cuda.is_available():
        return {"mode": "dp", "status": "unavailable",
                "reason": "nn.DataParallel replicates a module across CUDA devices inside one process; no CUDA device here"}
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_dp_proc, args=(args, q), daemon=True)
    p.start()
    try:
        status, payload = q.get(timeout=args["mode_timeout"])
    except queue.Empty:
        status, payload = "error", f"did not finish within {args['mode_timeout']:.0f}s"
    p.join(5)
    if p.is_alive():
        p.kill()
    if status != "ok":
        return {"mode": "dp", "status": status, "reason": payload.strip().splitlines()[-1] if payload else ""}
    return payload


def _dp_proc(args, q):
    try:
        q.put(("ok", _dp_body(args)))
    except torch.OutOfMemoryError as e:
        q.put(("oom", str(e).splitlines()[0]))
    except BaseException:  # noqa: BLE001
        q.put(("error", traceback.format_exc()))


def _dp_body(args):
    from . import workloads

    gpus = args["gpus"] or torch.cuda.device_count()
    devices = list(range(gpus))
    if args["mem_limit_mb"]:
        for d in devices:
            _cap_gpu_memory(torch.device("cuda", d), args["mem_limit_mb"])
    torch.manual_seed(0)
    wl = workloads.build(args["model"], width=args["width"], depth=args["depth"])
    inner = workloads.Checkpointed(wl.model) if args["checkpoint"] else wl.model
    model = torch.nn.DataParallel(inner.cuda(0), device_ids=devices)
    opt = torch.optim.SGD(model.parameters(), lr=args["lr"])
    amp_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(args["amp"])
    scaler = torch.amp.GradScaler("cuda") if args["amp"] == "fp16" else None
    sampler = _NvmlSampler(devices)

    def step(i):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for k in range(args["accum_steps"]):
            # The same global data as the DDP ranks see, concatenated in rank order.
            parts = [wl.make_batch(max(args["batch_size"] // gpus // args["accum_steps"], 1),
                                   seed=(i * args["accum_steps"] + k) * 1000 + r) for r in range(gpus)]
            x = torch.cat([a for a, _ in parts]).cuda(0)
            y = torch.cat([b for _, b in parts]).cuda(0)
            with torch.autocast("cuda", dtype=amp_dtype, enabled=amp_dtype is not None):
                loss = wl.loss(model(x).float(), y) / args["accum_steps"]
            (scaler.scale(loss) if scaler else loss).backward()
            total += float(loss.detach())
        _optimizer_step(opt, scaler)
        torch.cuda.synchronize()
        return total

    for i in range(args["warmup"]):
        step(i)
    for d in devices:
        torch.cuda.reset_peak_memory_stats(d)
    sampler.start()
    times, loss = [], 0.0
    for i in range(args["warmup"], args["warmup"] + args["iters"]):
        t0 = time.perf_counter()
        loss = step(i)
        times.append(time.perf_counter() - t0)
    util = sampler.stop()
    sync_ms = _profiled_comm_ms(lambda: step(args["warmup"] + args["iters"]))
    times.sort()
    median = statistics.median(times) * 1e3
    return {
        "mode": "dp", "status": "ok", "reason": "",
        "iter_ms": {"median": median, "p90": times[int(round(0.9 * (len(times) - 1)))] * 1e3},
        "samples_per_s": args["batch_size"] / (median / 1e3),
        "peak_memory_mb": [torch.cuda.max_memory_allocated(d) / 2**20 for d in devices],
        "util_percent": util,
        # DataParallel communicates on the compute streams: nothing hides it.
        "grad_sync_ms": {"total": sync_ms, "exposed": sync_ms},
        "final_loss": loss,
    }


def _profiled_comm_ms(step) -> float:
    """One extra iteration under torch.profiler: the busiest device's time in NCCL
    kernels and peer-to-peer copies, i.e. DataParallel's replicate (parameter
    broadcast), reduce-add (gradients to GPU 0), scatter and gather."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return comm_time_ms(prof.events())


def comm_time_ms(events) -> float:
    """Per device, the summed duration of communication kernels and copies (NCCL
    kernels, "Memcpy PtoP"); the largest per-device sum, in ms."""
    from torch.autograd import DeviceType

    per_device: dict[int, float] = {}
    for e in events:
        if e.device_type != DeviceType.CUDA:
            continue
        name = e.name.lower()
        if "nccl" in name or "ptop" in name:
            per_device[e.device_index] = per_device.get(e.device_index, 0.0) + e.time_range.elapsed_us()
    return max(per_device.values(), default=0.0) / 1e3


class _NvmlSampler:
    """GPU utilization sampled at 20 Hz through nvidia-ml-py (empty list without it)."""

    def __init__(self, devices):
        self.devices, self.samples, self._stop = devices, {d: [] for d in devices}, None

    def start(self):
        import threading

        try:
            import pynvml

            pynvml.nvmlInit()
            handles = [pynvml.nvmlDeviceGetHandleByIndex(d) for d in self.devices]
        except Exception:  # noqa: BLE001 - optional dependency
            return
        self._stop = threading.Event()

        def loop():
            while not self._stop.is_set():
                for d, h in zip(self.devices, handles):
                    self.samples[d].append(pynvml.nvmlDeviceGetUtilizationRates(h).gpu)
                time.sleep(0.05)

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()

    def stop(self):
        if self._stop is None:
            return []
        self._stop.set()
        self._thread.join(1)
        return [statistics.mean(self.samples[d]) if self.samples[d] else 0.0 for d in self.devices]


# -- report --------------------------------------------------------------------------------------
def _fmt_list(vals, fmt="{:.0f}"):
    if not vals or any(v is None for v in vals):
        return "-"
    if len(set(round(v) for v in vals)) == 1:
        return fmt.format(vals[0]) + f" (x{len(vals)})"
    return "/".join(fmt.format(v) for v in vals)


def table(doc: dict) -> str:
    modes = doc["modes"]
    ok = [m for m in modes if m["status"] == "ok"]
    base = next((m for m in ok if m["mode"] == "dp"), next((m for m in ok if m["mode"] == "ddp"), None))
    cols = [m.get("label", m["mode"]) for m in modes]
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
        row(f"speed vs {base['mode']}", lambda m: f"{base['iter_ms']['median'] / m['iter_ms']['median']:.2f}x")
    row("peak memory (MB) per rank/device", lambda m: _fmt_list(m["peak_memory_mb"]))
    row(UTILIZATION_ROW[doc["env"].get("device", "cpu")], lambda m: _fmt_list(m["util_percent"]))
    row("grad sync total (ms)", lambda m: "-" if m["grad_sync_ms"]["total"] is None else f"{m['grad_sync_ms']['total']:.1f}")
    row("grad sync exposed (ms)", lambda m: "-" if m["grad_sync_ms"]["exposed"] is None else f"{m['grad_sync_ms']['exposed']:.1f}")
    row("final loss", lambda m: f"{m['final_loss']:.5f}")
    if any("max_batch" in m for m in modes):
        rows.append("| max batch before OOM | " + " | ".join(
            "-" if "max_batch" not in m else (str(m["max_batch"]) if m["max_batch"] else "none found")
            for m in modes) + " |")
    head = "| metric | " + " | ".join(cols) + " |\n|---|" + "---|" * len(cols)
    notes = [f"- {m.get('label', m['mode'])}: {m['status']}: {m['reason']}" for m in modes if m["status"] != "ok"]
    return "\n".join([head] + rows + ([""] + notes if notes else []))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m commlab.compare", description=__doc__,
                                 epilog="Metric definitions:\n" + DEFINITIONS,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    ap.add_argument("--world-size", type=int, default=None, help="DDP ranks (default: 4 on CPU, every GPU on CUDA)")
    ap.add_argument("--gpus", type=int, default=None, help="GPUs for dp and ddp (default: all)")
    ap.add_argument("--modes", default=None, help="comma list, or all (default: dp, ddp, ddp:ring, ddp:ps, ddp:shm, ddp:noop)")
    ap.add_argument("--model", default=None, help="mlp | transformer | any torchvision model (default: mlp on CPU, resnet50 on GPU)")
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
    ap.add_argument("--lr", type=float, default=1e-3)
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
    ap.add_argument("--json"), ap.add_argument("--plot")
    a = ap.parse_args(argv)
    args = vars(a)
    try:
        caps = [float(c) for c in str(a.bucket_cap_mb).split(",") if c.strip()]
    except ValueError:
        ap.error(f"--bucket-cap-mb takes numbers, comma-separated for a sweep: {a.bucket_cap_mb!r}")
    if not caps or min(caps) <= 0:
        ap.error("--bucket-cap-mb must be positive")
    args["bucket_cap_mb"] = caps[0]
    if a.model is None:
        args["model"] = "resnet50" if a.device == "cuda" else "mlp"
    world = a.world_size or (4 if a.device == "cpu" else (a.gpus or torch.cuda.device_count()))
    if a.device == "cuda" and not a.share_gpu:
        from .launch import check_gpus_per_rank

        problem = check_gpus_per_rank(world, "nccl", torch.cuda.device_count())
        if problem:
            ap.error(problem + " (or pass --share-gpu for a functional check over gloo)")
    modes = all_modes(a.device) if a.modes == "all" else (a.modes.split(",") if a.modes else default_modes(a.device))
    from . import envinfo

    env = envinfo.collect(torch.device("cpu"))
    env.update(world_size=world, device=a.device, model=args["model"], batch_size=a.batch_size,
               bucket_cap_mb=caps if len(caps) > 1 else caps[0], mem_limit_mb=a.mem_limit_mb, amp=a.amp,
               checkpoint=a.checkpoint, accum_steps=a.accum_steps, share_gpu=a.share_gpu)
    if a.share_gpu:
        env["note"] = "--share-gpu: all DDP ranks on one GPU over gloo, a functional check, not a speed figure"
    results = []
    for mode in modes:
        # bucket_cap_mb shapes DDP's gradient buckets: swept for the modes that communicate.
        for cap in (caps if _is_ddp(mode) and mode != "ddp:noop" else caps[:1]):
            margs = dict(args, bucket_cap_mb=cap)
            label = f"{mode} @{cap:g}MB" if len(caps) > 1 and _is_ddp(mode) and mode != "ddp:noop" else mode
            print(f"# running {label} ...", file=sys.stderr, flush=True)
            res = run_mode(mode, world, margs)
            if _is_ddp(mode):
                res["bucket_cap_mb"] = cap
            if label != mode:
                res["label"] = label
            if a.find_max_batch and res["status"] in ("ok", "oom"):
                res["max_batch"], res["max_batch_probes"] = find_max_batch(mode, world, margs)
            results.append(res)
    doc = {"env": env, "modes": results}
    print("\n".join(envinfo.header_lines(env)))
    print()
    print(table(doc))
    print("\nDefinitions:\n" + DEFINITIONS.rstrip())
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=2)
    if a.plot:
        from .plots import plot_compare

        plot_compare(doc, a.plot)
    return 0 if any(m["status"] == "ok" for m in results) else 1


if __name__ == "__main__":
    sys.exit(main())
