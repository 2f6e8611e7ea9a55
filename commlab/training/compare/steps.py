"""What the ranks of every compare mode do alike in a training step (DDP's in workers.py,
ZeRO-1's and FSDP's in sharded.py): DDP's default reduction timed per bucket, one
optimizer step, the warm-up steps, and the emulated memory limit of CPU ranks."""
from __future__ import annotations

import datetime
import time

import psutil
import torch
import torch.distributed as dist

from commlab.training import workloads
from commlab.training.compare import metrics


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
