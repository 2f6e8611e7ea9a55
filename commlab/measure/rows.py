"""The rows of a benchmark: commlab's registered algorithms, and the external anchors
measured in the same run — MPI_Allreduce through mpi4py (MPICH or Open MPI, whichever
library mpi4py loaded) and DeepSpeed's CPU shared-memory all-reduce. Every row brings a
tight barrier made of its own transport (for --blocking), says what it cannot serve,
and cleans up what it leaves behind; the bench checks every row's results alike."""
from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from commlab import algorithms
from commlab.core.reduction import TO_TORCH, Op, finish_average_
from commlab.measure import launch
from commlab.measure.specs import SPECS, Outputs
from commlab.measure.timing import agree_min


@dataclass
class Row:
    name: str
    call: Callable[[torch.Tensor, Op], None]
    barrier: Callable[[], None]  # every rank leaves it only after all arrived, through this row's transport
    close: Callable[[], None] = field(default=lambda: None)
    about: str = ""  # the library and what it serves (the report's footer)
    # The result of the latest call on input t: t itself for all-reduce (in place), the
    # row's own output buffer for all-gather.
    output: Callable[[torch.Tensor], torch.Tensor] = field(default=lambda t: t)


def _barrier_of(call: Callable[[torch.Tensor, Op], None], device) -> Callable[[], None]:
    """A one-element all-reduce through the same transport: no rank leaves before every
    rank arrived, and the transport's own synchronisation is what is timed."""
    token = torch.zeros(1, dtype=torch.float32, device=device)
    return lambda: call(token, Op.SUM)


def registry_rows(names: list[str], device, collective: str = "all_reduce") -> list[Row]:
    spec = SPECS[collective]
    family = algorithms.registry(collective)
    rows = []
    for n in names:
        if device.type not in family.get(n).devices:
            continue
        out = Outputs.of(spec, device)

        def call(t, op, n=n, out=out):
            spec.run(n, out(t) if out else None, t, op)

        # The barrier's one-element call has an output of its own: sharing the call's
        # would reallocate a 64 MiB output around every isolated call, timed with it.
        token_out = Outputs.of(spec, device)
        token = torch.zeros(spec.count(4, 4, dist.get_world_size()), dtype=torch.float32, device=device)

        def barrier(n=n, token_out=token_out, token=token):
            spec.run(n, token_out(token) if token_out else None, token, Op.SUM)

        rows.append(Row(n, call, barrier, output=out or (lambda t: t)))
    if "builtin" in names and device.type == "cpu" and dist.get_backend() == "commlab" and collective == "all_reduce":
        # On a commlab group `builtin` is the backend's inner gloo (what commlab's own
        # algorithms issue); unchanged training code gets dist.all_reduce on the backend.
        def backend_call(t, op):
            dist.all_reduce(t, op=TO_TORCH[op])

        rows.append(Row("builtin@commlab", backend_call, _barrier_of(backend_call, device),
                        about="torch.distributed.all_reduce on the commlab backend (COMMLAB_ALGORITHM, default auto)"))
    return rows


MPI_DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8)  # numpy has no bfloat16


def mpi_row(dtype: torch.dtype, op: Op, device, collective: str = "all_reduce") -> Row | str:
    """The collective through mpi4py (MPI_Allreduce, MPI_Allgather,
    MPI_Reduce_scatter_block: SPECS); only when mpiexec launched us, with its own MPI
    library (launch.mpi_world)."""
    if dtype not in MPI_DTYPES:
        return f"mpi: mpi4py has no {dtype} buffers"
    MPI, why = launch.mpi_world()
    if MPI is None:
        return f"mpi: {why}"
    comm = MPI.COMM_WORLD
    version = MPI.Get_library_version().strip().splitlines()[0]
    library = "openmpi" if "Open MPI" in version else ("mpich" if "MPICH" in version else "mpi")
    mpi_ops = {Op.SUM: MPI.SUM, Op.AVG: MPI.SUM, Op.PRODUCT: MPI.PROD, Op.MIN: MPI.MIN, Op.MAX: MPI.MAX}

    spec = SPECS[collective]
    if spec.output is not None:
        if device.type != "cpu":
            return f"mpi: {collective} of host buffers only"
        out = Outputs.of(spec, "cpu")

        def other(t: torch.Tensor, op: Op) -> None:
            spec.mpi(comm, MPI, mpi_ops[op], out(t), t)
            if op is Op.AVG and spec.reduces:
                finish_average_(out(t), comm.Get_size())

        return Row(f"mpi:{library}", other, comm.Barrier, about=f"{version} through mpi4py ({spec.mpi_name})",
                   output=out)

    def call(t: torch.Tensor, op: Op) -> None:
        spec.mpi(comm, MPI, mpi_ops[op], None, t)
        if op is Op.AVG:
            finish_average_(t, comm.Get_size())

    about = f"{version} through mpi4py; serves SUM, AVG, PRODUCT, MIN, MAX of " + ", ".join(
        str(d).replace("torch.", "") for d in MPI_DTYPES)
    if device.type == "cuda":
        def staged(t: torch.Tensor, op: Op) -> None:
            # mpi4py takes host buffers (a CUDA-aware MPI is not assumed): through the host.
            host = t.cpu()
            call(host, op)
            t.copy_(host)

        return Row(f"mpi:{library}:host-staged", staged, comm.Barrier, about=about)
    return Row(f"mpi:{library}", call, comm.Barrier, about=about)


DEEPSPEED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # others it silently leaves unreduced


def deepspeed_row(dtype: torch.dtype, op: Op, device, collective: str = "all_reduce") -> Row | str:
    """DeepSpeed's CPU shared-memory all-reduce (torch.ops.deepspeed.inference_all_reduce_,
    JIT-built with ninja on first use). It sums only, serves only 16/32-bit floats, needs
    LOCAL_SIZE equal to the world size (else it crashes) and never unlinks its segments:
    close() does."""
    if collective != "all_reduce":
        return f"deepspeed_shm: its CPU shared-memory module serves all-reduce only, not {collective}"
    if device.type != "cpu":
        return "deepspeed_shm: CPU tensors only"
    if op not in (Op.SUM, Op.AVG) or dtype not in DEEPSPEED_DTYPES:
        return f"deepspeed_shm: sums float32, float16 and bfloat16 only (not {op.name} of {dtype})"
    world, rank = dist.get_world_size(), dist.get_rank()
    if launch.active().local_world_size != world:
        return "deepspeed_shm: every rank must be on this host"
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ["LOCAL_SIZE"] = str(world)
    why = None
    try:
        # optional: the DeepSpeed peer row
        import deepspeed

        # optional: the DeepSpeed peer row
        from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

        module = ShareMemCommBuilder().load(verbose=False)
    except Exception as e:  # noqa: BLE001 - an optional peer: say why it is missing
        why = f"deepspeed_shm: deepspeed is not usable here ({type(e).__name__}: {e})"[:200]
    # Its setup waits for every rank's segment forever: start it only where all can.
    if not agree_min(int(why is None), device):
        return why or "deepspeed_shm: not usable on every rank"
    module.initialize(world, rank)
    prefix = f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_" \
             f"{os.environ.get('MASTER_PORT', '')}_"

    def call(t: torch.Tensor, op: Op) -> None:
        torch.ops.deepspeed.inference_all_reduce_(t)
        if op is Op.AVG:
            finish_average_(t, world)

    def close() -> None:
        dist.barrier()  # every rank has mapped every segment long ago
        if rank == 0:
            for path in glob.glob(prefix + "*"):
                os.unlink(path)

    about = f"DeepSpeed {deepspeed.__version__} CPU shared-memory all-reduce; serves SUM (and AVG) of float32, " \
            "float16, bfloat16"
    return Row("deepspeed_shm", call, _barrier_of(call, device), close, about)


ANCHORS = {"mpi": mpi_row, "deepspeed": deepspeed_row}


def anchor_rows(which: str, dtype: torch.dtype, op: Op, device, collective: str = "all_reduce"
                ) -> tuple[list[Row], list[str]]:
    """The anchors asked for (`all`, `none`, or a comma list of ANCHORS' names): the rows
    that can run here, and a line for each that cannot, with why."""
    names = list(ANCHORS) if which == "all" else ([] if which == "none" else [w.strip() for w in which.split(",")])
    rows, notes = [], []
    for name in names:
        if name not in ANCHORS:
            raise SystemExit(f"allreduce_bench: unknown anchor {name!r} (anchors: {', '.join(ANCHORS)})")
        got = ANCHORS[name](dtype, op, device, collective)
        (notes if isinstance(got, str) else rows).append(got)
    return rows, notes
