"""Starting the process group from whatever launched us: torchrun (env://), mpiexec
(rank and size from the MPI environment, rendezvous address broadcast through MPI),
or our own local spawn of N ranks on loopback."""
from __future__ import annotations

import datetime
import gc
import os
import socket
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

_MPI_RANK = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")
_MPI_SIZE = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")
_MPI_LOCAL = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK")


@dataclass(frozen=True)
class Launch:
    kind: str  # "torchrun" | "mpi" | "spawn" | "single"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int = 1  # ranks on this host


def _env_int(names) -> int | None:
    for n in names:
        if n in os.environ:
            return int(os.environ[n])
    return None


_MPI_LOCAL_SIZE = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "MV2_COMM_WORLD_LOCAL_SIZE")


def detect() -> Launch:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        size = int(os.environ["WORLD_SIZE"])
        return Launch("torchrun", int(os.environ["RANK"]), size, int(os.environ.get("LOCAL_RANK", "0")),
                      int(os.environ.get("LOCAL_WORLD_SIZE", str(size))))
    rank, size = _env_int(_MPI_RANK), _env_int(_MPI_SIZE)
    if rank is not None and size is not None:
        return Launch("mpi", rank, size, _env_int(_MPI_LOCAL) or 0, _env_int(_MPI_LOCAL_SIZE) or size)
    return Launch("single", 0, 1, 0, 1)


def check_gpus_per_rank(local_ranks: int, backend: str, gpus: int) -> str | None:
    """Why these ranks cannot each have a GPU of their own (None when they can). NCCL
    needs one GPU per rank: ranks sharing one fail or hang inside NCCL."""
    if gpus == 0:
        return "no CUDA device is visible (--device cuda)"
    if backend == "nccl" and local_ranks > gpus:
        return (f"{local_ranks} ranks on this host but {gpus} GPU(s): NCCL needs a GPU per rank; start at most "
                f"{gpus} ranks (torchrun --nproc_per_node={gpus}), or use --backend gloo to share GPUs")
    return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_backend(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


_active: Launch | None = None


def active() -> Launch:
    """How this process was launched, as init() saw it (init rewrites RANK/WORLD_SIZE)."""
    return _active or detect()


def init(launch: Launch, backend: str, timeout_s: float, device: str) -> None:
    global _active
    _active = launch
    timeout = datetime.timedelta(seconds=timeout_s)
    if device == "cuda":
        problem = check_gpus_per_rank(launch.local_world_size, backend, torch.cuda.device_count())
        if problem:
            from .errors import CommlabError

            raise CommlabError(f"commlab: {problem}")
        torch.cuda.set_device(launch.local_rank % torch.cuda.device_count())
    if launch.kind == "mpi":
        from mpi4py import MPI  # rendezvous through MPI itself: no fixed port to collide on

        comm = MPI.COMM_WORLD
        addr = comm.bcast((socket.gethostname(), free_port()) if launch.rank == 0 else None, root=0)
        os.environ.setdefault("MASTER_ADDR", addr[0] if comm.Get_size() > 1 else "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(addr[1]))
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(launch.rank), str(launch.world_size)
    elif launch.kind == "single":
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        os.environ["RANK"], os.environ["WORLD_SIZE"] = "0", "1"
    dist.init_process_group(backend, init_method="env://", rank=launch.rank,
                            world_size=launch.world_size, timeout=timeout)


def leave(together: bool = True) -> None:
    """Leave the process group (together: after a barrier) and free it while the
    interpreter is alive.

    The barrier: gloo can abort a process whose peers tear their connections down while
    it still uses them. The collect: a group that only dies during interpreter shutdown
    has gloo worker threads releasing Python-owned tensors after the GIL is gone, which
    aborts the process; nothing of commlab's holds a group (groups.py), but cycles in the
    caller's objects can, so they go now.
    """
    if not dist.is_initialized():
        return
    try:
        if together:
            dist.barrier()
    finally:
        dist.destroy_process_group()
        gc.collect()


def _spawned(rank: int, world_size: int, port: int, target: Callable, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    target(*args)


def spawn(world_size: int, target: Callable, args: tuple = ()) -> None:
    """Run target(*args) on world_size local ranks that look torchrun-launched."""
    import torch.multiprocessing as mp

    port = free_port()
    mp.start_processes(_spawned, args=(world_size, port, target, args), nprocs=world_size,
                       start_method="spawn", join=True)
