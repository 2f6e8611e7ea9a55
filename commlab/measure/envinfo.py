"""The environment header every benchmark and comparison prints first."""
from __future__ import annotations

import os
import platform
import socket

import torch
import torch.distributed as dist

import commlab
from commlab.core import ext
from commlab.measure.launch import active, mpi_world


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def collect(device: torch.device) -> dict:

    env = {
        "commlab": commlab.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "device": device.type,
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "commlab_C_cuda": ext.HAS_CUDA,
    }
    hosts = [socket.gethostname()]
    if dist.is_initialized() and dist.get_world_size() > 1:
        hosts = [None] * dist.get_world_size()
        dist.all_gather_object(hosts, socket.gethostname())
    env["hosts"] = sorted(set(hosts))
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(device if device.type == "cuda" else 0)
        env["cuda"] = torch.version.cuda
        try:
            v = torch.cuda.nccl.version()
            env["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:  # noqa: BLE001 - informational only
            env["nccl"] = None

    how = active()
    env["launcher"] = how.launcher or how.kind
    if how.kind == "mpi":
        mpi, why = mpi_world()
        env["mpi"] = mpi.Get_library_version().splitlines()[0].strip() if mpi is not None else f"not used: {why}"
    return env


# Reported in the footer, next to the results they explain.
FOOTER_KEYS = ("anchors", "anchors_missing", "timing", "group_bandwidth_gbps", "group_bandwidth_fast_gbps",
               "handoffs", "hot_copy_us")


def header_lines(env: dict) -> list[str]:
    return [f"# {k}: {v}" for k, v in env.items() if k not in FOOTER_KEYS]
