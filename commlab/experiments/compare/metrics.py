"""What compare samples and how: GPU busy through NVML, DataParallel's communication
time from one profiled iteration, and a smaller card emulated by an allocator cap."""
from __future__ import annotations

import statistics
import threading
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile


class NvmlSampler:
    """GPU utilization sampled at 20 Hz through nvidia-ml-py (empty list without it)."""

    def __init__(self, devices):
        self.devices, self.samples, self._stop = devices, {d: [] for d in devices}, None

    def start(self):

        try:
            # optional (nvidia-ml-py): only where NVML is asked
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


def profiled_comm_ms(step) -> float:
    """One extra iteration under torch.profiler: the busiest device's time in NCCL
    kernels and peer-to-peer copies, i.e. DataParallel's replicate (parameter
    broadcast), reduce-add (gradients to GPU 0), scatter and gather."""

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return comm_time_ms(prof.events())


def _is_comm(event) -> bool:
    """A device event that is communication: an NCCL kernel or a peer-to-peer copy."""
    name = event.name.lower()
    return "nccl" in name or "ptop" in name


def comm_time_ms(events) -> float:
    """Per device, the summed duration of communication kernels and copies (NCCL
    kernels, "Memcpy PtoP"); the largest per-device sum, in ms."""

    per_device: dict[int, float] = {}
    for e in events:
        if e.device_type != DeviceType.CUDA:
            continue
        if _is_comm(e):
            per_device[e.device_index] = per_device.get(e.device_index, 0.0) + e.time_range.elapsed_us()
    return max(per_device.values(), default=0.0) / 1e3


def profiled_sync_ms(step) -> dict:
    """One step under torch.profiler: the busiest device's communication time (total) and
    the part of it during which no other kernel or copy ran on that device (exposed) —
    how DDP's NCCL all-reduces and the sharded modes' collectives, issued on NCCL's and
    FSDP's own streams, are timed on a GPU, where the host sees only their launch."""

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return comm_overlap_ms(prof.events())


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(spans) -> float:
    return sum(b - a for a, b in spans)


def _minus(spans, cover) -> float:
    """The length of the union `spans` not covered by the union `cover` (both sorted)."""
    left, j = 0.0, 0
    for a, b in spans:
        at = a
        while j < len(cover) and cover[j][1] <= at:
            j += 1
        k = j
        while k < len(cover) and cover[k][0] < b:
            left += max(0.0, min(cover[k][0], b) - at)
            at = max(at, cover[k][1])
            k += 1
        left += max(0.0, b - at)
    return left


def comm_overlap_ms(events) -> dict:
    """Per device, the union of its communication intervals (NCCL kernels, peer copies)
    and the part of that union no other device activity overlaps (Holistic Trace
    Analysis's exposed communication); the busiest device's, in ms."""

    comm: dict[int, list] = {}
    other: dict[int, list] = {}
    for e in events:
        if e.device_type != DeviceType.CUDA:
            continue
        into = comm if _is_comm(e) else other
        into.setdefault(e.device_index, []).append((e.time_range.start, e.time_range.end))
    best = {"total": 0.0, "exposed": 0.0}
    for d, spans in comm.items():
        mine = _union(spans)
        total, exposed = _length(mine) / 1e3, _minus(mine, _union(other.get(d, []))) / 1e3
        if total > best["total"]:
            best = {"total": total, "exposed": exposed}
    return best


def cap_gpu_memory(device, limit_mb: float) -> None:
    """Make this process's caching allocator behave like a card of limit_mb (the seed's
    24 GB RTX 4090 on a bigger GPU): allocations beyond it raise OutOfMemoryError."""
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, limit_mb * 2**20 / total), device)
