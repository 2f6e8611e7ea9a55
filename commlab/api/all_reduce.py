"""commlab.all_reduce: torch.distributed.all_reduce's contract over any registered algorithm."""
from __future__ import annotations

import torch
import torch.distributed as dist

from commlab import algorithms
from commlab.api import family
from commlab.core import groups
from commlab.core.errors import UnsupportedError
from commlab.core.reduction import SUPPORTED_DTYPES, Op, finish_average_, parse_op


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
    if not async_op and type(tensor) is torch.Tensor:  # others: the long way
        plan = family.fast_plan(("all_reduce", algorithm, id(op), id(group)))
        if plan is not None and plan.op_key is op and family.run_fast(plan, tensor):
            return None
    return family.run(_plan(tensor, op, group, algorithm), tensor, tensor, async_op)


class _Plan(family.Plan):
    collective = "all_reduce"

    def refusal(self, out, inp, p):
        return None  # in place: one tensor, whose dtype the plan has checked


    def body(self, out, inp, root, extra):
        if self.info.size == 1:
            return
        op = Op.SUM if self.reduce_op is Op.AVG else self.reduce_op
        # Algorithms work on one flat contiguous buffer; a strided caller's view gets the
        # result copied back, like gloo does for non-dense inputs.
        if inp.is_contiguous():
            buf = inp if inp.dim() == 1 else inp.view(-1)
            self.alg.run(buf, op, self.ctx)
            if self.reduce_op is Op.AVG:
                finish_average_(buf, self.info.size)
            return
        buf = inp.contiguous().view(-1)
        self.alg.run(buf, op, self.ctx)
        if self.reduce_op is Op.AVG:
            finish_average_(buf, self.info.size)
        inp.copy_(buf.view(inp.shape))


_plans = family.Plans()


def _plan(tensor, op, group, algorithm: str) -> _Plan:
    # The key is built from the cheapest attributes there are: tensor.device.type and
    # hashing a ReduceOp cost more than a small shm call's transport
    # (docs/measurements.md#figures-behind-the-codes-choices). The op is keyed by
    # identity; the plan keeps it alive, so its id cannot be reused while the plan is
    # cached, and an equal op of another identity just takes the slow path.
    family.check_tensors("all_reduce", tensor)
    key = family.key_of(algorithm, id(op), id(group), tensor.dtype, tensor.is_cpu, tensor.is_cuda)
    plan = _plans.get(key, op)
    if plan is not None:
        return plan
    alg = algorithms.get(algorithm)
    reduce_op = parse_op(op)
    if tensor.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)
        raise UnsupportedError(f"commlab: dtype {tensor.dtype} is not supported (supported: {names})")
    info = groups.resolve(group)
    family.check_device(alg, "all_reduce", tensor)
    reason = alg.unsupported(tensor, Op.SUM if reduce_op is Op.AVG else reduce_op, info)
    if reason:
        raise UnsupportedError(f"commlab[{alg.name}]: {reason}")
    plan = _Plan(alg, info, algorithms.names, reduce_op, op)
    # AVG divides after the exchange, in Python: only the long way does it.
    return _plans.put(key, plan, tensor, None if reduce_op is Op.AVG else ("all_reduce", algorithm, id(op), id(group)))
