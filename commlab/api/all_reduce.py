"""commlab.all_reduce: torch.distributed.all_reduce's contract over any registered algorithm."""
from __future__ import annotations

import torch
import torch.distributed as dist

from commlab import algorithms
from commlab.api import family
from commlab.core.reduction import Op, finish_average_


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
    if not async_op and isinstance(tensor, torch.Tensor):  # the transport's call checks the rest itself
        plan = family.fast_plan(("all_reduce", algorithm, id(op), id(group)))
        if plan is not None and plan.op_key is op and family.run_fast(plan, tensor):
            return None
    return family.run(_plans.plan(algorithm, group, tensor, tensor, op=op), tensor, tensor, async_op)


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


_plans = family.Plans(_Plan, algorithms, reduces=True)
