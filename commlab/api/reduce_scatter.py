"""commlab.reduce_scatter: torch.distributed.reduce_scatter_tensor's contract over any
registered reduce-scatter algorithm."""
from __future__ import annotations

import torch
import torch.distributed as dist

from commlab.algorithms import reduce_scatter as family_
from commlab.api import family
from commlab.core.reduction import Op, finish_average_


def reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=None, *, algorithm: str = "ring",
                   async_op: bool = False):
    """Reduce every rank's `input` (world size blocks of output.numel() elements, rank
    order) with `op` and leave block `rank` of the result in `output`, with the named
    algorithm.

    torch.distributed.reduce_scatter_tensor's contract: `input` of any shape and layout
    holding world size × output.numel() elements (flat, or stacked as (world size,
    *output.shape)), `output` of any layout, possibly a view of this rank's block of
    `input` (left as it was otherwise); SUM, AVG, PRODUCT, MIN, MAX over every common
    dtype; with async_op=True returns a handle with wait(), is_completed() and
    get_future()."""
    if not async_op and type(output) is torch.Tensor and type(input) is torch.Tensor:  # others: the long way
        plan = family.fast_plan(("reduce_scatter", algorithm, id(op), id(group)))
        if plan is not None and plan.op_key is op and family.run_fast(plan, output, input):
            return None
    return family.run(_plans.plan(algorithm, group, input, output, input, op=op), output, input, async_op)


class _Plan(family.Plan):
    collective = "reduce_scatter"

    def sizes(self, out, inp, p):
        if inp.numel() != p * out.numel():
            return (f"input holds {inp.numel()} elements, needs world size {p} × output's {out.numel()} = "
                    f"{p * out.numel()}")
        return None

    def body(self, out, inp, root, extra):
        p = self.info.size
        flat_in = inp.reshape(-1) if inp.is_contiguous() else inp.contiguous().view(-1)
        if p == 1:
            result = flat_in.clone() if self.reduce_op is Op.AVG else flat_in
        else:
            # A private result when out is strided or shares memory with the input
            # (NCCL's in-place convention: out is this rank's block of inp).
            own = out.is_contiguous() and not family.overlaps(out, flat_in)
            result = out.view(-1) if own else torch.empty(out.numel(), dtype=out.dtype, device=out.device)
            self.alg.run(result, flat_in, Op.SUM if self.reduce_op is Op.AVG else self.reduce_op, self.ctx)
        if self.reduce_op is Op.AVG:
            finish_average_(result, p)
        if result.data_ptr() != out.data_ptr() or not out.is_contiguous():
            out.copy_(result.view(out.shape))


_plans = family.Plans(_Plan, family_, reduces=True)
