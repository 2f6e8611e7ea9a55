"""commlab.broadcast: torch.distributed.broadcast's contract over any registered
broadcast algorithm."""
from __future__ import annotations

import torch

from commlab.algorithms import broadcast as family_
from commlab.api import family


def broadcast(tensor, src: int | None = None, group=None, *, algorithm: str = "binomial", async_op: bool = False,
              group_src: int | None = None):
    """Every rank's `tensor` becomes the `src` rank's, with the named algorithm.

    torch.distributed.broadcast's contract: `src` a global rank (or `group_src` a rank of
    `group`), `tensor` of any shape, layout and dtype, in place; every rank ends with
    the root's bits; with async_op=True returns a handle with wait(), is_completed()
    and get_future()."""
    # Plain tensors and int roots only: anything else goes the long way, which explains.
    if not async_op and type(tensor) is torch.Tensor:
        plan = family.fast_plan(("broadcast", algorithm, id(group)))
        if plan is not None:
            if group_src is None:
                root = plan.root_of.get(src) if type(src) is int else None
            else:
                root = group_src if src is None else None
            if type(root) is int and family.run_fast(plan, tensor, root):
                return None
    plan = _plans.plan(algorithm, group, tensor, tensor)
    if (src is None) == (group_src is None):
        plan.refuse(f"takes one of src (a global rank) and group_src, got src={src}, group_src={group_src}")
    if group_src is None:
        if src not in plan.info.global_ranks:
            plan.refuse(f"src {src} is not a rank of this group (its global ranks: {list(plan.info.global_ranks)})")
        group_src = plan.info.global_ranks.index(src)
    elif not 0 <= group_src < plan.info.size:
        plan.refuse(f"group_src {group_src} is not a rank of this group of {plan.info.size}")
    return family.run(plan, tensor, tensor, async_op, group_src)


class _Plan(family.Plan):
    collective = "broadcast"

    def __init__(self, *args):
        super().__init__(*args)
        self.root_of = {g: r for r, g in enumerate(self.info.global_ranks)}  # a global src's group rank

    def sizes(self, out, inp, p):
        return None  # one tensor: nothing of its own can be wrong once it is a strided tensor

    def body(self, out, inp, root, extra):
        if self.info.size == 1:
            return
        if out.is_contiguous():
            self.alg.run(out.view(-1), root, self.ctx)
            return
        buf = out.contiguous().view(-1)  # the root's values travel; others' are overwritten
        self.alg.run(buf, root, self.ctx)
        out.copy_(buf.view(out.shape))


_plans = family.Plans(_Plan, family_)
