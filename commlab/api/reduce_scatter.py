"""commlab.reduce_scatter: torch.distributed.reduce_scatter_tensor's contract over any
registered reduce-scatter algorithm."""
from __future__ import annotations

import torch
import torch.distributed as dist

from commlab.algorithms import reduce_scatter as family
from commlab.algorithms.base import Context
from commlab.api import lanes
from commlab.core import groups
from commlab.core.errors import CollectiveMismatchError, UnsupportedError
from commlab.core.reduction import SUPPORTED_DTYPES, Op, finish_average_, parse_op
from commlab.transports.p2p import P2P, CallRecord


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
    plan = _plan(output, input, op, group, algorithm)
    if not async_op and plan.lane.try_inline():
        try:
            with lanes.running():
                plan.execute(output, input)
        finally:
            plan.lane.end_inline()
        return None
    return plan.lane.submit(lambda: plan.execute(output, input), output, async_op)


class _Plan:
    """What depends only on (algorithm, op, group, dtype, device type): validated once."""

    def __init__(self, alg, reduce_op: Op, info: groups.GroupInfo, op_key):
        self.alg = alg
        self.reduce_op = reduce_op
        self.core_op = Op.SUM if reduce_op is Op.AVG else reduce_op
        self.info = info
        self.op_key = op_key
        self.ctx = Context(info=info, p2p=P2P(info, alg.name))
        self.lane = lanes.lane(info.group)
        self.agree = None  # whether every call is agreed first: decided on the first call

    def execute(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        p = self.info.size
        bad = _sizes(out, inp, p)
        if bad:
            # This rank's own arguments, which its peers cannot see: it gives the group up,
            # so they raise at once naming it instead of waiting for it.
            refused = UnsupportedError(f"commlab[{self.alg.name}]: reduce_scatter {bad}")
            if p > 1:
                self.ctx.p2p.give_up(refused)
            raise refused
        try:
            if self.agree is None:  # collective: every rank's first call of the plan asks here
                if p > 1:
                    self.alg.prepare(inp, self.ctx)
                self.agree = p > 1 and not self.alg.checks_calls(self.ctx)
            # An empty call too: its peers may not be empty (shared memory skips empty calls
            # without a record, so an empty one is agreed: the records' sizes differ there).
            if self.agree or (out.numel() == 0 and p > 1):
                self.ctx.p2p.agree(CallRecord("reduce_scatter", inp.numel(), inp.dtype, self.reduce_op,
                                              self.alg.name), family.names)
            if out.numel() == 0:
                return
            flat_in = inp.reshape(-1) if inp.is_contiguous() else inp.contiguous().view(-1)
            if p == 1:
                result = flat_in
            else:
                # A private result when out is strided or shares memory with the input
                # (NCCL's in-place convention: out is this rank's block of inp).
                own = out.is_contiguous() and not _overlaps(out, flat_in)
                result = out.view(-1) if own else torch.empty(out.numel(), dtype=out.dtype, device=out.device)
                self.alg.run(result, flat_in, self.core_op, self.ctx)
            if self.reduce_op is Op.AVG:
                result = result if result is not flat_in else result.clone()
                finish_average_(result, p)
            if result.data_ptr() != out.data_ptr() or not out.is_contiguous():
                out.copy_(result.view(out.shape))
        except (CollectiveMismatchError, UnsupportedError):
            raise  # raised alike on every rank, from facts they share
        except BaseException as e:
            # A rank that fails mid-call: its peers, who wait on it in the agreement or the
            # next step, raise now, naming it.
            if p > 1:
                self.ctx.p2p.give_up(e)
            raise


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _sizes(out: torch.Tensor, inp: torch.Tensor, p: int) -> str | None:
    """What is wrong with this rank's pair, from its own arguments alone."""
    if out.dtype != inp.dtype:
        return f"output dtype {out.dtype} differs from input dtype {inp.dtype}"
    if out.device != inp.device:
        return f"output on {out.device}, input on {inp.device}"
    if inp.numel() != p * out.numel():
        return (f"input holds {inp.numel()} elements, needs world size {p} × output's {out.numel()} = "
                f"{p * out.numel()}")
    return None


_plans: dict[tuple, _Plan] = {}
_MAX_PLANS = 256


def _plan(out, inp, op, group, algorithm: str) -> _Plan:
    for t in (out, inp):
        if not isinstance(t, torch.Tensor):
            raise UnsupportedError(f"commlab: reduce_scatter expects torch.Tensors, got {type(t).__name__}")
        if t.layout != torch.strided:
            raise UnsupportedError(f"commlab: only dense (strided) tensors are supported, got {t.layout}")
    try:
        key = (algorithm, id(op), id(group), inp.dtype, inp.is_cpu, inp.is_cuda)
        plan = _plans.get(key)
    except TypeError:  # an unhashable algorithm name: let validation explain
        key, plan = None, None
    if plan is not None and plan.op_key is op and plan.info.alive():
        return plan
    alg = family.get(algorithm)
    reduce_op = parse_op(op)
    if inp.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)
        raise UnsupportedError(f"commlab: reduce_scatter of dtype {inp.dtype} is not supported (supported: {names})")
    info = groups.resolve(group)
    if inp.device.type not in alg.devices:
        raise UnsupportedError(f"commlab[{alg.name}]: tensors on {inp.device.type} are not supported "
                               f"(this reduce_scatter algorithm serves {', '.join(alg.devices)})")
    reason = alg.unsupported(inp, Op.SUM if reduce_op is Op.AVG else reduce_op, info)
    if reason:
        raise UnsupportedError(f"commlab[{alg.name}]: {reason}")
    plan = _Plan(alg, reduce_op, info, op)
    if key is not None and (inp.is_cpu or inp.is_cuda):
        if len(_plans) >= _MAX_PLANS:
            _plans.clear()
        _plans[key] = plan
    return plan
