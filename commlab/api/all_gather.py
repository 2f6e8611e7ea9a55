"""commlab.all_gather: torch.distributed.all_gather_into_tensor's contract over any
registered all-gather algorithm."""
from __future__ import annotations

import torch

from commlab.algorithms import all_gather as family
from commlab.algorithms.base import Context
from commlab.api import lanes
from commlab.core import groups
from commlab.core.errors import CollectiveMismatchError, UnsupportedError
from commlab.transports.p2p import P2P, CallRecord


def all_gather(output, input, group=None, *, algorithm: str = "ring", async_op: bool = False):
    """Gather every rank's `input` into `output` (world size × input.numel() elements,
    rank order) with the named algorithm.

    torch.distributed.all_gather_into_tensor's contract: `output` of any shape and
    layout holding world size × input.numel() elements (flat, or stacked as
    (world size, *input.shape)), `input` of any layout, possibly a view of this rank's
    block of `output`; every dtype; every rank ends with bitwise-identical output; with
    async_op=True returns a handle with wait(), is_completed() and get_future()."""
    plan = _plan(output, input, group, algorithm)
    if not async_op and plan.lane.try_inline():
        try:
            with lanes.running():
                plan.execute(output, input)
        finally:
            plan.lane.end_inline()
        return None
    return plan.lane.submit(lambda: plan.execute(output, input), output, async_op)


class _Plan:
    """What depends only on (algorithm, group, dtype, device type): validated once."""

    def __init__(self, alg, info: groups.GroupInfo):
        self.alg = alg
        self.info = info
        self.ctx = Context(info=info, p2p=P2P(info, alg.name))
        self.lane = lanes.lane(info.group)
        self.agree = None  # whether every call is agreed first: decided on the first call

    def execute(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        p = self.info.size
        bad = _sizes(out, inp, p)
        if bad:
            # This rank's own arguments, which its peers cannot see: it gives the group up,
            # so they raise at once naming it instead of waiting for it.
            refused = UnsupportedError(f"commlab[{self.alg.name}]: all_gather {bad}")
            if p > 1:
                self.ctx.p2p.give_up(refused)
            raise refused
        try:
            if self.agree is None:  # collective: every rank's first call of the plan asks here
                if p > 1:
                    self.alg.prepare(out, self.ctx)
                self.agree = p > 1 and not self.alg.checks_calls(self.ctx)
            # An empty call too: its peers may not be empty (shared memory skips empty calls
            # without a record, so an empty one is agreed: the records' sizes differ there).
            if self.agree or (inp.numel() == 0 and p > 1):
                self.ctx.p2p.agree(CallRecord("all_gather", inp.numel(), inp.dtype, None, self.alg.name),
                                   family.names)
            if inp.numel() == 0:
                return
            flat_in = inp.reshape(-1) if inp.is_contiguous() else inp.contiguous().view(-1)
            if p == 1:
                out.view(-1).copy_(flat_in) if out.is_contiguous() else out.copy_(flat_in.view(out.shape))
                return
            if out.is_contiguous():
                self.alg.run(out.view(-1), flat_in, self.ctx)
                return
            buf = torch.empty(out.numel(), dtype=out.dtype, device=out.device)
            self.alg.run(buf, flat_in, self.ctx)
            out.copy_(buf.view(out.shape))
        except (CollectiveMismatchError, UnsupportedError):
            raise  # raised alike on every rank, from facts they share
        except BaseException as e:
            # A rank that fails mid-call: its peers, who wait on it in the agreement or the
            # next step, raise now, naming it.
            if p > 1:
                self.ctx.p2p.give_up(e)
            raise


def _sizes(out: torch.Tensor, inp: torch.Tensor, p: int) -> str | None:
    """What is wrong with this rank's pair, from its own arguments alone (both are
    strided tensors: _plan checked)."""
    if out.dtype != inp.dtype:
        return f"output dtype {out.dtype} differs from input dtype {inp.dtype}"
    if out.device != inp.device:
        return f"output on {out.device}, input on {inp.device}"
    if out.numel() != p * inp.numel():
        return (f"output holds {out.numel()} elements, needs world size {p} × input's {inp.numel()} = "
                f"{p * inp.numel()}")
    return None


_plans: dict[tuple, _Plan] = {}
_MAX_PLANS = 256


def _plan(out, inp, group, algorithm: str) -> _Plan:
    for t in (out, inp):
        if not isinstance(t, torch.Tensor):
            raise UnsupportedError(f"commlab: all_gather expects torch.Tensors, got {type(t).__name__}")
        if t.layout != torch.strided:
            raise UnsupportedError(f"commlab: only dense (strided) tensors are supported, got {t.layout}")
    try:
        key = (algorithm, id(group), out.dtype, out.is_cpu, out.is_cuda)
        plan = _plans.get(key)
    except TypeError:  # an unhashable algorithm name: let validation explain
        key, plan = None, None
    if plan is not None and plan.info.alive():
        return plan
    alg = family.get(algorithm)
    info = groups.resolve(group)
    if out.device.type not in alg.devices:
        raise UnsupportedError(f"commlab[{alg.name}]: tensors on {out.device.type} are not supported "
                               f"(this all_gather algorithm serves {', '.join(alg.devices)})")
    reason = alg.unsupported(out, info)
    if reason:
        raise UnsupportedError(f"commlab[{alg.name}]: {reason}")
    plan = _Plan(alg, info)
    if key is not None and (out.is_cpu or out.is_cuda):
        if len(_plans) >= _MAX_PLANS:
            _plans.clear()
        _plans[key] = plan
    return plan
