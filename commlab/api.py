"""commlab.all_reduce: torch.distributed.all_reduce's contract over any registered algorithm."""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import algorithms, groups, lanes
from .algorithms.base import Context
from .errors import UnsupportedError
from .p2p import P2P
from .reduction import SUPPORTED_DTYPES, Op, finish_average_, parse_op


def algorithm_names() -> list[str]:
    return algorithms.names()


def get_algorithm(name: str):
    return algorithms.get(name)


def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, *, algorithm: str = "ring", async_op: bool = False):
    """Reduce `tensor` in place across `group` with the named algorithm.

    Same contract as torch.distributed.all_reduce: in place, any size and layout, every
    rank ends with bitwise-identical data; with async_op=True returns a handle with
    wait(), is_completed() and get_future(). Everything that could make one rank refuse
    is checked here, before any traffic, from facts all ranks share.
    """
    alg = algorithms.get(algorithm)
    reduce_op = parse_op(op)
    _check_tensor(tensor)
    info = groups.resolve(group)
    core_op = Op.SUM if reduce_op is Op.AVG else reduce_op
    if tensor.device.type not in alg.devices:
        raise UnsupportedError(
            f"commlab[{alg.name}]: tensors on {tensor.device.type} are not supported "
            f"(this algorithm serves {', '.join(alg.devices)})"
        )
    reason = alg.unsupported(tensor, core_op, info)
    if reason:
        raise UnsupportedError(f"commlab[{alg.name}]: {reason}")

    def job() -> None:
        _execute(alg, tensor, reduce_op, core_op, info)

    return lanes.lane(info.group).submit(job, tensor, async_op)


def _check_tensor(tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise UnsupportedError(f"commlab: all_reduce expects a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise UnsupportedError(f"commlab: only dense (strided) tensors are supported, got {tensor.layout}")
    if tensor.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)
        raise UnsupportedError(f"commlab: dtype {tensor.dtype} is not supported (supported: {names})")


def _execute(alg, tensor: torch.Tensor, reduce_op: Op, core_op: Op, info: groups.GroupInfo) -> None:
    if tensor.numel() == 0 or info.size == 1:
        return
    # Algorithms work on one flat contiguous buffer; a strided caller's view gets the
    # result copied back, like gloo does for non-dense inputs.
    direct = tensor.is_contiguous()
    buf = tensor.view(-1) if direct else tensor.contiguous().view(-1)
    alg.run(buf, core_op, Context(info=info, p2p=P2P(info, alg.name)))
    if reduce_op is Op.AVG:
        finish_average_(buf, info.size)
    if not direct:
        tensor.copy_(buf.view(tensor.shape))
