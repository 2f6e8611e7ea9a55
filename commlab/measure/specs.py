"""What the benchmark needs to know about each collective, in one place: how a size
becomes a per-rank buffer (nccl-tests' convention: the size is the all-reduced buffer,
the gathered output, the reduce-scattered input, the broadcast message, each rank's
all-to-all input), how one call runs through commlab or
through MPI, and what every rank must hold afterwards (#wrong). The bench, its rows and
the checks iterate SPECS; nothing else branches on a collective's name."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

import commlab
from commlab.core.reduction import Op, finish_average_

# The check patterns repeat every 5 elements (sums) or 2 (products): they are built over one
# period and tiled, so a 64 MiB check costs one pass, not the dozen an arange's arithmetic
# took (the #wrong check was a quarter of the README's run after it went once per size).
PERIOD = 10


def _tiled(period: torch.Tensor, count: int) -> torch.Tensor:
    if count <= period.numel():
        return period[:count].clone()
    return period.repeat(-(-count // period.numel()))[:count].clone()


def check_input(rank: int, count: int, dtype: torch.dtype, op: Op, device) -> torch.Tensor:
    """Small integers, exact in every dtype, so #wrong is an exact count."""
    i = torch.arange(min(count, PERIOD), dtype=torch.int64)
    v = ((i + rank) % 2 + 1) if op is Op.PRODUCT else ((i * 7 + rank * 3) % 5)
    return _tiled(v.to(dtype), count).to(device)


def reduced(p: int, count: int, dtype: torch.dtype, op: Op, device) -> torch.Tensor:
    """The reduction over p ranks of check_input, computed exactly."""
    xs = torch.stack([check_input(r, min(count, PERIOD), torch.int64, op, "cpu") for r in range(p)])
    red = {Op.PRODUCT: lambda: xs.prod(0), Op.MIN: lambda: xs.amin(0), Op.MAX: lambda: xs.amax(0)}.get(
        op, lambda: xs.sum(0))().to(dtype)
    if op is Op.AVG:
        finish_average_(red, p)
    return _tiled(red, count).to(device)


class Outputs:
    """One output buffer per row, for the size being measured (the previous size's is
    dropped: 64 MiB outputs add up); `elements(n)`: the output's elements for an input of n."""

    def __init__(self, device, elements: Callable[[int], int]):
        self.device, self.elements, self.key, self.buf = device, elements, None, None

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        key = (t.numel(), t.dtype)
        if key != self.key:
            self.key, self.buf = key, torch.empty(self.elements(t.numel()), dtype=t.dtype, device=self.device)
        return self.buf

    @staticmethod
    def of(spec: "Spec", device) -> "Outputs | None":
        """The output buffers of a collective's calls; None where the call is in place."""
        if spec.output is None:
            return None
        p = dist.get_world_size()
        return Outputs(device, lambda n: spec.output(n, p))


@dataclass(frozen=True)
class Spec:
    name: str
    reduces: bool  # whether --op applies (the report's redop column)
    floors: bool  # whether the memory-bandwidth floors of the all-reduce rows are measured
    tunes: bool  # whether --tune writes a tuning file (auto reads one for all-reduce only so far)
    size_note: str  # what a row's size is, for the report's header
    count: Callable[[int, int, int], int]  # (bytes, itemsize, p) -> elements of the per-rank input
    size: Callable[[int, int, int], int]  # (count, itemsize, p) -> the size reported
    output: Callable[[int, int], int] | None  # (count, p) -> output elements; None: in place
    run: Callable  # (algorithm, out, inp, op) through commlab
    want: Callable  # (rank, p, count, dtype, op, device) -> what the output must hold
    mpi: Callable  # (comm, MPI, mpi_op, out, inp) one call through mpi4py's host buffers
    mpi_name: str


def _all_reduce(alg, out, inp, op):
    commlab.all_reduce(inp, op=op, algorithm=alg)


def _mpi_all_reduce(comm, MPI, mpi_op, out, inp):
    comm.Allreduce(MPI.IN_PLACE, inp.numpy(), op=mpi_op)


def _mpi_all_gather(comm, MPI, mpi_op, out, inp):
    comm.Allgather(inp.numpy(), out.numpy())


def _mpi_reduce_scatter(comm, MPI, mpi_op, out, inp):
    comm.Reduce_scatter_block(inp.numpy(), out.numpy(), op=mpi_op)


def _mpi_broadcast(comm, MPI, mpi_op, out, inp):
    comm.Bcast(inp.numpy(), root=0)


def _mpi_all_to_all(comm, MPI, mpi_op, out, inp):
    comm.Alltoall(inp.numpy(), out.numpy())


def _exchanged(rank: int, p: int, count: int, dtype: torch.dtype, device) -> torch.Tensor:
    """What all_to_all of check_input leaves on `rank`: block `rank` of every rank's input."""
    return torch.cat([check_input(j, count, dtype, Op.SUM, device).view(p, -1)[rank] for j in range(p)])


SPECS = {
    "all_reduce": Spec(
        "all_reduce", True, True, True, "",
        count=lambda nbytes, item, p: max(nbytes // item, 1),
        size=lambda count, item, p: count * item,
        output=None,
        run=_all_reduce,
        want=lambda rank, p, count, dtype, op, device: reduced(p, count, dtype, op, device),
        mpi=_mpi_all_reduce, mpi_name="MPI_Allreduce"),
    "all_gather": Spec(
        "all_gather", False, False, False, "size: the gathered output; count: elements per rank",
        count=lambda nbytes, item, p: max(nbytes // item // p, 1),
        size=lambda count, item, p: count * item * p,
        output=lambda count, p: count * p,
        run=lambda alg, out, inp, op: commlab.all_gather(out, inp, algorithm=alg),
        want=lambda rank, p, count, dtype, op, device: torch.cat(
            [check_input(r, count, dtype, Op.SUM, device) for r in range(p)]),
        mpi=_mpi_all_gather, mpi_name="MPI_Allgather"),
    "reduce_scatter": Spec(
        "reduce_scatter", True, False, False, "size: the reduced input; count: its elements per rank",
        count=lambda nbytes, item, p: max(nbytes // item // p, 1) * p,
        size=lambda count, item, p: count * item,
        output=lambda count, p: count // p,
        run=lambda alg, out, inp, op: commlab.reduce_scatter(out, inp, op, algorithm=alg),
        want=lambda rank, p, count, dtype, op, device: reduced(p, count, dtype, op, device).view(p, -1)[rank],
        mpi=_mpi_reduce_scatter, mpi_name="MPI_Reduce_scatter_block"),
    "broadcast": Spec(
        "broadcast", False, False, False, "from rank 0",
        count=lambda nbytes, item, p: max(nbytes // item, 1),
        size=lambda count, item, p: count * item,
        output=None,
        run=lambda alg, out, inp, op: commlab.broadcast(inp, src=0, algorithm=alg),
        want=lambda rank, p, count, dtype, op, device: check_input(0, count, dtype, Op.SUM, device),
        mpi=_mpi_broadcast, mpi_name="MPI_Bcast"),
    "all_to_all": Spec(
        "all_to_all", False, False, False, "size: each rank's input (p blocks); count: its elements",
        count=lambda nbytes, item, p: max(nbytes // item // p, 1) * p,
        size=lambda count, item, p: count * item,
        output=lambda count, p: count,
        run=lambda alg, out, inp, op: commlab.all_to_all(out, inp, algorithm=alg),
        want=lambda rank, p, count, dtype, op, device: _exchanged(rank, p, count, dtype, device),
        mpi=_mpi_all_to_all, mpi_name="MPI_Alltoall"),
}


def check_op(spec: Spec, op: Op) -> Op:
    """The op a row's check runs: SUM where the collective reduces nothing."""
    return op if spec.reduces else Op.SUM

