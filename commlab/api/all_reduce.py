"""commlab.all_reduce: torch.distributed.all_reduce's contract over any registered algorithm."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from commlab import algorithms
from commlab.algorithms.base import Context
from commlab.api import lanes
from commlab.core import groups
from commlab.core.errors import CollectiveMismatchError, UnsupportedError
from commlab.core.reduction import SUPPORTED_DTYPES, Op, finish_average_, parse_op
from commlab.transports.p2p import P2P


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
    if not isinstance(tensor, torch.Tensor):
        raise UnsupportedError(f"commlab: all_reduce expects a torch.Tensor, got {type(tensor).__name__}")
    if not async_op:
        # The fast path: a blocking call like one already planned runs in one transport
        # call, no Python layer below this one.
        try:
            plan = _fast.get((algorithm, id(op), id(group)))
        except TypeError:  # an unhashable algorithm name: let validation explain
            plan = None
        if plan is not None and plan.op_key is op and plan.live() and plan.lane.try_inline():
            try:
                done = plan.fast(tensor)
            finally:
                plan.lane.end_inline()
            if done:
                return None
    plan = _plan(tensor, op, group, algorithm)
    if not async_op and plan.lane.try_inline():
        try:
            with lanes.running():  # what the algorithm issues on the group is commlab's own traffic
                plan.execute(tensor)
        finally:
            plan.lane.end_inline()
        return None
    return plan.lane.submit(lambda: plan.execute(tensor), tensor, async_op)


class _Plan:
    """Everything about a call that depends only on (algorithm, op, group, dtype,
    device type): validated once, then reused, because per-call Python work is a
    visible share of a small shared-memory all-reduce."""

    def __init__(self, alg, reduce_op: Op, info: groups.GroupInfo, op_key):
        self.alg = alg
        self.reduce_op = reduce_op
        self.average = reduce_op is Op.AVG
        self.core_op = Op.SUM if self.average else reduce_op
        self.info = info
        self.ctx = Context(info=info, p2p=P2P(info, alg.name), op=reduce_op)
        self.lane = lanes.lane(info.group)
        self.check = checking_enabled()
        self.op_key = op_key  # the caller's op object this plan is cached under
        self.fast = None  # the algorithm's fast call, where it has one and the call allows it
        self.agree = None  # whether every call is checked first (P2P.checker): decided on the first call
        self.checked = None  # the check, bound on the first call

    def live(self) -> bool:
        return self.info.alive()

    def execute(self, tensor: torch.Tensor) -> None:
        if self.check and self.info.size > 1:
            _check_match(self, tensor)
        if self.info.size == 1:
            return
        try:
            self._run(tensor)
        except (CollectiveMismatchError, UnsupportedError):
            raise  # raised alike on every rank
        except BaseException as e:
            # Its peers wait on this rank's next step, maybe in another of the call's
            # groups than the one that failed: they raise now.
            self.ctx.p2p.give_up(e)
            raise

    def _run(self, tensor: torch.Tensor) -> None:
        if self.agree is None:  # collective: every rank's first call of the plan asks here
            self.agree = not self.alg.checks_calls(tensor, self.ctx)
        if self.agree:  # an empty call too: its peers may not be empty
            if self.checked is None:  # bound once: the check runs on every call of the plan
                self.checked = self.ctx.p2p.checker("all_reduce", tensor.dtype, self.reduce_op, self.alg.name,
                                                    algorithms.names, cuda=tensor.is_cuda)
            self.checked(tensor.numel())
        if tensor.numel() == 0:
            if not self.agree:  # the transport checks it like any call
                self.alg.run(tensor.view(-1), self.core_op, self.ctx)
            return
        # Algorithms work on one flat contiguous buffer; a strided caller's view gets
        # the result copied back, like gloo does for non-dense inputs.
        if tensor.is_contiguous():
            self.alg.run(tensor if tensor.dim() == 1 else tensor.view(-1), self.core_op, self.ctx)
            if self.average:
                finish_average_(tensor, self.info.size)
            return
        buf = tensor.contiguous().view(-1)
        self.alg.run(buf, self.core_op, self.ctx)
        if self.average:
            finish_average_(buf, self.info.size)
        tensor.copy_(buf.view(tensor.shape))


def checking_enabled() -> bool:
    """COMMLAB_CHECK=1, or torch's own TORCH_DISTRIBUTED_DEBUG=DETAIL."""
    return os.environ.get("COMMLAB_CHECK", "0") not in ("", "0") or \
        os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL"


def _check_match(plan: _Plan, tensor: torch.Tensor) -> None:
    """Every rank shows what it passed; any difference raises the same error everywhere."""
    mine = (tensor.numel(), str(tensor.dtype).replace("torch.", ""), plan.reduce_op.name, plan.alg.name)
    seen = [None] * plan.info.size
    dist.all_gather_object(seen, mine, group=plan.info.group)
    if any(s != seen[0] for s in seen):
        detail = "; ".join(f"rank {plan.info.global_rank(r)}: numel={s[0]} dtype={s[1]} op={s[2]} algorithm={s[3]}"
                           for r, s in enumerate(seen))
        raise CollectiveMismatchError(f"commlab: ranks called all_reduce differently: {detail}")


_plans: dict[tuple, _Plan] = {}
# (algorithm, op, group) -> the latest plan with a fast call: its call checks the rest
# (dtype, device, layout) itself, so the key is three cheap values.
_fast: dict[tuple, _Plan] = {}
_MAX_PLANS = 256


def _plan(tensor: torch.Tensor, op, group, algorithm: str) -> _Plan:
    # The key is built from the cheapest attributes there are: tensor.device.type and
    # hashing a ReduceOp cost more than a small shm call's transport
    # (docs/measurements.md#figures-behind-the-codes-choices). The op is keyed by
    # identity; the plan keeps it alive, so its id cannot be reused while the plan is
    # cached, and an equal op of another identity just takes the slow path.
    try:
        key = (algorithm, id(op), id(group), tensor.dtype, tensor.is_cpu, tensor.is_cuda, tensor.layout)
        plan = _plans.get(key)
    except TypeError:  # an unhashable algorithm name: let validation explain
        key, plan = None, None
    if plan is not None and plan.op_key is op and plan.live():
        if plan.fast is not None:  # the fast path serves the latest dtype of (algorithm, op, group)
            _fast[key[:3]] = plan
        return plan
    alg = algorithms.get(algorithm)
    reduce_op = parse_op(op)
    _check_tensor(tensor)
    info = groups.resolve(group)
    device_type = tensor.device.type
    if device_type not in alg.devices:
        raise UnsupportedError(
            f"commlab[{alg.name}]: tensors on {device_type} are not supported "
            f"(this algorithm serves {', '.join(alg.devices)})"
        )
    core_op = Op.SUM if reduce_op is Op.AVG else reduce_op
    reason = alg.unsupported(tensor, core_op, info)
    if reason:
        raise UnsupportedError(f"commlab[{alg.name}]: {reason}")
    plan = _Plan(alg, reduce_op, info, op)
    # Devices other than CPU and CUDA share (False, False) in the key: never cached.
    if key is not None and (tensor.is_cpu or tensor.is_cuda):
        if len(_plans) >= _MAX_PLANS:  # ops built afresh for every call would each add one
            _plans.clear()
            _fast.clear()
        _plans[key] = plan
        # Checked calls, AVG's division and one-rank groups need the long way.
        if not plan.check and not plan.average and info.size > 1:
            plan.fast = alg.fast_call(tensor, core_op, plan.ctx)
            if plan.fast is not None:
                _fast[key[:3]] = plan
    return plan


def _check_tensor(tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise UnsupportedError(f"commlab: all_reduce expects a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise UnsupportedError(f"commlab: only dense (strided) tensors are supported, got {tensor.layout}")
    if tensor.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)
        raise UnsupportedError(f"commlab: dtype {tensor.dtype} is not supported (supported: {names})")
