"""What the ranks of every compare mode do alike in a training step (DDP's in workers.py,
ZeRO-1's and FSDP's in sharded.py): DDP's default reduction timed per bucket, one
optimizer step, the warm-up steps, and the emulated memory limit of CPU ranks."""
from __future__ import annotations

import datetime
import resource
import time
from dataclasses import dataclass

import psutil
import torch
import torch.distributed as dist

from commlab.experiments import workloads
from commlab.experiments.compare import metrics


def start_rank(rank: int, world: int, args: dict, backend: str | None = None):
    """What every mode's rank does first: its device, the process group (`backend`, else
    NCCL on GPUs and gloo on CPUs), the emulated memory cap and the model, built from seed
    0 on the device. Returns (device, the workload, its model, the RSS before the model)."""
    cuda = args["device"] == "cuda"
    device = torch.device("cuda", rank % max(torch.cuda.device_count(), 1)) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(backend or ("nccl" if cuda else "gloo"), init_method="env://", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=args["timeout"]))
    if cuda and args["mem_limit_mb"]:
        metrics.cap_gpu_memory(device, args["mem_limit_mb"])
    rss_before_model = psutil.Process().memory_info().rss
    torch.manual_seed(0)
    wl = workloads.build(args["model"], **workloads.options(args))
    return device, wl, wl.model.to(device), rss_before_model


def timed_default_hook(stats, bucket):
    """DDP's default reduction (divide by the world size, dist.all_reduce on DDP's group),
    with each bucket timed in a hooks.BucketStats: the `ddp` mode."""
    buf = bucket.buffer()
    t0 = time.perf_counter()
    it = stats.begin(bucket)
    buf.div_(dist.get_world_size())
    fut = dist.all_reduce(buf, async_op=True).get_future()

    def done(f):
        stats.finish(it, bucket.index(), buf.numel() * buf.element_size(), t0, time.perf_counter())
        return f.value()[0]

    return fut.then(done)


def optimizer_step(opt, scaler) -> None:
    """One optimizer step, through the GradScaler when fp16 AMP uses one."""
    if scaler:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()


def timed_micro_batch(loss_of, scaler, spans: list) -> torch.Tensor:
    """One micro-batch's forward (loss_of() gives its loss) and backward, each appended
    to `spans` as (phase, start, end); returns the loss."""
    t0 = time.perf_counter()
    loss = loss_of()
    t1 = time.perf_counter()
    (scaler.scale(loss) if scaler else loss).backward()
    spans.extend((("forward", t0, t1), ("backward", t1, time.perf_counter())))
    return loss


def timed_optimizer_step(opt, scaler, cuda: bool, spans: list) -> float:
    """optimizer_step after the device finished backward, timed to the device's end too;
    appended to `spans`, and returned in seconds."""
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    optimizer_step(opt, scaler)
    if cuda:
        torch.cuda.synchronize()
    spans.append(("optimizer", t0, time.perf_counter()))
    return spans[-1][2] - t0


def emulate_memory_limit(peak_rss: int, rss_before_model: int, limit_mb: float | None) -> None:
    """CPU has no allocator limit: emulate --mem-limit-mb on what training added to the
    process, agreed across ranks so they all stop together (every CPU mode alike)."""
    if not limit_mb:
        return
    over = torch.tensor([(peak_rss - rss_before_model) / 2**20], dtype=torch.float64)
    dist.all_reduce(over, op=dist.ReduceOp.MAX)
    if over.item() > limit_mb:
        raise torch.OutOfMemoryError(f"emulated: a rank's training memory peaked at {over.item():.0f} MB, above "
                                     f"--mem-limit-mb {limit_mb:g}")


def warm_up(step, n: int, on_device: bool) -> dict | None:
    """The n warm-up steps; on_device: the last of them (warm, and not one the table times)
    under torch.profiler, whose device sync figures it returns (metrics.profiled_sync_ms)."""
    if on_device and n < 1:
        raise ValueError("collectives timed on the device are timed in the last warm-up step: warmup must be >= 1")
    for i in range(n - 1 if on_device else n):
        step(i)
    return metrics.profiled_sync_ms(lambda: step(n - 1)) if on_device else None


def timed_steps(step, args: dict, device: torch.device) -> tuple[list[float], float, float | None]:
    """The timed steps after the warm-up: (each step's seconds, the last step's loss, the
    utilisation: the GPU's as NVML samples it, else this process's CPU share in %)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    sampler = metrics.NvmlSampler([device.index]) if cuda else None  # one metric per device type, as DP's
    if sampler is not None:
        sampler.start()
    proc = psutil.Process()
    cpu0, wall0 = sum(proc.cpu_times()[:2]), time.perf_counter()
    times, loss = [], 0.0
    for i in range(args["warmup"], args["warmup"] + args["iters"]):
        t0 = time.perf_counter()
        loss = step(i)
        times.append(time.perf_counter() - t0)
    if sampler is not None:
        return times, loss, (sampler.stop() or [None])[0]
    return times, loss, (sum(proc.cpu_times()[:2]) - cpu0) / (time.perf_counter() - wall0) * 100


def across_ranks(times: list[float], loss: float, device: torch.device, world: int) -> tuple[list[float], float]:
    """(The slowest rank's time of each step, the ranks' mean loss), on every rank; over
    the device where the group's backend reduces device tensors (NCCL), else the host."""
    on = device if device.type == "cuda" and dist.get_backend() == "nccl" else torch.device("cpu")
    slowest = torch.tensor(times, dtype=torch.float64, device=on)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    mean_loss = torch.tensor([loss], dtype=torch.float64, device=on)
    dist.all_reduce(mean_loss)
    return slowest.cpu().tolist(), float(mean_loss.item()) / world


def peak_memory_mb(device: torch.device, rss_before_model: int, args: dict) -> float:
    """The device's peak allocation, or on a CPU this process's peak RSS (Linux: KiB; the
    true peak, mid-step too), checked against the emulated memory limit."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    emulate_memory_limit(peak_rss, rss_before_model, args["mem_limit_mb"])
    return peak_rss / 2**20


@dataclass
class RankResult:
    """What one rank of a DDP, ZeRO-1 or FSDP mode measured, sent back to compare, which
    builds the mode's row from every rank's (modes.run_ddp_mode)."""

    times: list[float]  # every timed step's seconds, the slowest rank's
    loss: float  # the ranks' mean final loss
    memory_mb: float  # the device's peak allocation, or this process's peak RSS
    util: float | None  # GPU utilisation (NVML), or this process's CPU share, %
    sync_total: float  # ms of gradient synchronisation per step
    sync_exposed: float  # of which not hidden behind compute, ms
    comm_bytes: float  # bytes a step's collectives moved
    trace: dict  # this rank's spans (measure.trace.record): the exposed sync's split
    tensor_mb: float | None = None  # the step's own tensors at their peak (CPU)
    tensor_breakdown_mb: dict | None = None
    params: list | None = None  # the trained parameters, where asked (return_params)
    optimizer_ms: float | None = None  # the optimizer's step, median of the timed steps (DDP)
    # ddp:noop on one host: what this host's wait for the last rank is predicted from.
    arrival_skew_ms: float | None = None
    backward_end_ms: list | None = None
    unit_waits_ms: dict | None = None
    wait_se_ms: dict | None = None
