"""commlab.all_gather: torch.distributed.all_gather_into_tensor's contract over any
registered all-gather algorithm."""
from __future__ import annotations

import torch

from commlab.algorithms import all_gather as family_
from commlab.api import family


def all_gather(output, input, group=None, *, algorithm: str = "ring", async_op: bool = False):
    """Gather every rank's `input` into `output` (world size × input.numel() elements,
    rank order) with the named algorithm.

    torch.distributed.all_gather_into_tensor's contract: `output` of any shape and
    layout holding world size × input.numel() elements (flat, or stacked as
    (world size, *input.shape)), `input` of any layout, possibly a view of this rank's
    block of `output`; every dtype; every rank ends with bitwise-identical output; with
    async_op=True returns a handle with wait(), is_completed() and get_future()."""
    if not async_op and type(output) is torch.Tensor and type(input) is torch.Tensor:  # others: the long way
        plan = family.fast_plan(("all_gather", algorithm, id(group)))
        if plan is not None and family.run_fast(plan, output, input):
            return None
    return family.run(_plans.plan(algorithm, group, output, output, input), output, input, async_op)


class _Plan(family.Plan):
    collective = "all_gather"

    def sizes(self, out, inp, p):
        if out.numel() != p * inp.numel():
            return (f"output holds {out.numel()} elements, needs world size {p} × input's {inp.numel()} = "
                    f"{p * inp.numel()}")
        return None

    def body(self, out, inp, root, extra):
        flat_in = inp.reshape(-1) if inp.is_contiguous() else inp.contiguous().view(-1)
        if self.info.size == 1:
            out.view(-1).copy_(flat_in) if out.is_contiguous() else out.copy_(flat_in.view(out.shape))
            return
        if out.is_contiguous():
            self.alg.run(out.view(-1), flat_in, self.ctx)
            return
        buf = torch.empty(out.numel(), dtype=out.dtype, device=out.device)
        self.alg.run(buf, flat_in, self.ctx)
        out.copy_(buf.view(out.shape))


_plans = family.Plans(_Plan, family_)
