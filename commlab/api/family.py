"""What every collective family's API shares (commlab.all_reduce, commlab.all_gather,
commlab.reduce_scatter, commlab.all_to_all, commlab.broadcast): a call's plan (validated once per algorithm, group, dtype and device type), the
order of a call — this rank's own arguments refused and the group given up, the
algorithm's collective first-call decision, the agreement, the run — and its failure
contract, the lane that runs it inline or async, and the plan cache. Each family's
module says only what differs: its sizes, its call record and its body."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from commlab.algorithms.base import Context
from commlab.api import lanes
from commlab.core import groups
from commlab.core.errors import CollectiveMismatchError, UnsupportedError
from commlab.core.reduction import SUPPORTED_DTYPES, Op, parse_op
from commlab.transports.p2p import P2P
from commlab.transports.records import CallRecord


class Plan:
    """One family's call on one (algorithm, group, dtype, device type[, op])."""

    collective = ""

    def __init__(self, alg, info: groups.GroupInfo, names, reduce_op: Op | None = None, op_key=None):
        self.alg = alg
        self.info = info
        self.names = names  # the family's registry names: how the agreement decodes a record
        self.reduce_op = reduce_op
        self.op_key = op_key  # the caller's op object the plan is cached under
        self.ctx = Context(info=info, p2p=P2P(info, alg.name), op=reduce_op)
        self.lane = lanes.lane(info.group)
        self.agree = None  # whether every call is agreed first: decided on the first call
        self.fast = None  # the algorithm's one-call path for blocking calls, decided on the first call
        self.fast_key = None  # (collective, algorithm, group[, op]): where the fast path finds this plan
        self.checks: dict = {}  # root -> the agreement of every call of this plan, bound once (P2P.checker)
        self.debug = checking_enabled()  # every call also compared through the group's own backend

    # -- what a family says -------------------------------------------------------------

    def refusal(self, out: torch.Tensor, inp: torch.Tensor, p: int) -> str | None:
        """What is wrong with this rank's own arguments, or None: a pair of one dtype on one
        device, and the family's sizes (`sizes`)."""
        if out.dtype != inp.dtype:
            return f"output dtype {out.dtype} differs from input dtype {inp.dtype}"
        if out.device != inp.device:
            return f"output on {out.device}, input on {inp.device}"
        return self.sizes(out, inp, p)

    def sizes(self, out: torch.Tensor, inp: torch.Tensor, p: int) -> str | None:
        raise NotImplementedError

    def record_numel(self, out: torch.Tensor, inp: torch.Tensor) -> int:
        """The size every rank's call must share (the agreement's and the error's)."""
        return inp.numel()

    def empty(self, out: torch.Tensor, inp: torch.Tensor) -> bool:
        return inp.numel() == 0

    def record(self, out: torch.Tensor, inp: torch.Tensor, root: int, extra) -> CallRecord:
        """What every rank's call must share, agreed before any byte moves."""
        return CallRecord(self.collective, self.record_numel(out, inp), inp.dtype, self.reduce_op, self.alg.name, root,
                          cuda=inp.is_cuda)

    def body(self, out: torch.Tensor, inp: torch.Tensor, root: int, extra) -> None:
        """The call itself (root: a group rank, or -1 where the collective has none; extra:
        what else the family's call carries, e.g. all_to_all's counts)."""
        raise NotImplementedError

    # -- the order of a call and its failure contract -------------------------------------

    def refuse(self, bad: str):
        """This rank's own arguments, which its peers cannot see: it gives the group up, so
        they raise at once naming it instead of waiting for it. Under COMMLAB_CHECK its
        peers wait in the comparison's gather, which a give-up does not reach: the refusal
        goes through that gather instead, and every rank raises it (nothing was sent: the
        group stays usable)."""
        refused = UnsupportedError(f"commlab[{self.alg.name}]: {self.collective} {bad}")
        if self.info.size > 1:
            if self.debug:
                self._shown(("refused", str(refused)))
            self.ctx.p2p.give_up(refused)
        raise refused

    def agreement(self, out: torch.Tensor, inp: torch.Tensor, root: int, extra):
        """Every rank's record of this call compared before any byte moves (P2P.agree).
        A call the record says all of, but its size, has its check bound once per root
        (the per-call price of a small checked call); returns all_to_all's agreed counts."""
        if extra is not None:
            return self.ctx.p2p.agree(self.record(out, inp, root, extra), self.names)
        check = self.checks.get(root)
        if check is None:
            check = self.checks[root] = self.ctx.p2p.checker(self.collective, inp.dtype, self.reduce_op, self.alg.name,
                                                             self.names, root, cuda=inp.is_cuda)
        check(self.record_numel(out, inp))
        return None

    def _shown(self, mine: tuple) -> list:
        """Every rank's `mine` through the group's own backend (COMMLAB_CHECK); where a rank
        refused its own arguments, every rank raises that refusal."""
        seen = [None] * self.info.size
        dist.all_gather_object(seen, mine, group=self.info.group)
        refused = [(q, s[1]) for q, s in enumerate(seen) if s[0] == "refused"]
        if refused:
            q, text = refused[0]
            raise UnsupportedError(text if q == self.info.rank else f"rank {self.info.global_rank(q)} refused: {text}")
        return seen

    def compare(self, out: torch.Tensor, inp: torch.Tensor, root: int, extra) -> None:
        """COMMLAB_CHECK=1: every rank shows its call through the group's own backend;
        any difference raises the same error everywhere."""
        r = self.record(out, inp, root, extra)
        mine = ("call", r.elements, str(r.dtype).replace("torch.", ""), r.op.name if r.op is not None else "-",
                r.algorithm, r.root)
        seen = self._shown(mine)
        if any(s != seen[0] for s in seen):
            detail = "; ".join(f"rank {self.info.global_rank(q)}: numel={s[1]} dtype={s[2]} op={s[3]} algorithm={s[4]}"
                               + (f" root={s[5]}" if s[5] >= 0 else "") for q, s in enumerate(seen))
            raise CollectiveMismatchError(f"commlab: ranks called {self.collective} differently: {detail}")

    def execute(self, out: torch.Tensor, inp: torch.Tensor, root: int = -1, extra=None) -> None:
        p = self.info.size
        bad = self.refusal(out, inp, p)
        if bad:
            self.refuse(bad)
        if self.debug and p > 1:
            self.compare(out, inp, root, extra)
        try:
            if self.agree is None:  # collective: every rank's first call of the plan asks here
                if p > 1:
                    self.alg.prepare(inp, self.ctx)
                self.agree = p > 1 and not self.alg.checks_calls(self.ctx)
                if p > 1 and not self.agree and self.fast_key is not None and not self.debug:
                    self.fast = self.alg.fast_call(inp, self.reduce_op, self.ctx)
                    if self.fast is not None:
                        _fast[self.fast_key] = self
            if self.agree:  # an empty call too: its peers may not be empty
                agreed = self.agreement(out, inp, root, extra)
                if agreed is not None:  # all_to_all: every rank's counts, as a matrix
                    extra = extra.agreed(agreed)
            # Where the transport compares records itself, an empty call goes down to it:
            # there it publishes its record like any other call and checks its peers'
            # (agreeing it elsewhere left a peer with data waiting in the transport).
            if not self.agree or not self.empty(out, inp):
                self.body(out, inp, root, extra)
        except (CollectiveMismatchError, UnsupportedError):
            raise  # raised alike on every rank, from facts they share
        except BaseException as e:
            # A rank that fails mid-call: its peers, who wait on it in the agreement or the
            # next step, raise now, naming it.
            if p > 1:
                self.ctx.p2p.give_up(e)
            raise


def checking_enabled() -> bool:
    """COMMLAB_CHECK=1, or torch's own TORCH_DISTRIBUTED_DEBUG=DETAIL."""
    return os.environ.get("COMMLAB_CHECK", "0") not in ("", "0") or \
        os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL"


def run(plan: Plan, out: torch.Tensor, inp: torch.Tensor, async_op: bool, root: int = -1, extra=None):
    """The call on its group's lane: inline when nothing is queued and the caller waits,
    else queued behind the group's earlier calls (a handle when async_op)."""
    if not async_op and plan.lane.try_inline():
        try:
            with lanes.running():
                plan.execute(out, inp, root, extra)
        finally:
            plan.lane.end_inline()
        return None
    return plan.lane.submit(lambda: plan.execute(out, inp, root, extra), out, async_op)


# (collective, algorithm, group[, op]) -> the latest plan whose algorithm runs a blocking
# call below Python: that call checks the rest (dtype, device, layout, sizes) itself, so
# the key is a few cheap values: a small call's Python is otherwise most of its time
# (docs/measurements.md#figures-behind-the-codes-choices).
_fast: dict[tuple, Plan] = {}


def fast_plan(key: tuple) -> Plan | None:
    """The plan a blocking call keyed so may try first, or None."""
    try:
        plan = _fast.get(key)
    except TypeError:  # an unhashable algorithm name: the long way explains
        return None
    return plan if plan is not None and plan.info.alive() else None


def run_fast(plan: Plan, *args) -> bool:
    """The call in one transport call, inline, when its lane is idle and the transport
    takes its tensors; False, nothing done, otherwise (the caller goes the long way)."""
    if not plan.lane.try_inline():
        return False
    try:
        return plan.fast(*args)
    finally:
        plan.lane.end_inline()


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors share bytes (an output that is a view of the input needs a
    private result)."""
    if a.numel() == 0 or b.numel() == 0 or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def check_tensors(collective: str, *tensors) -> None:
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise UnsupportedError(f"commlab: {collective} expects torch.Tensors, got {type(t).__name__}")
        if t.layout != torch.strided:
            raise UnsupportedError(f"commlab: only dense (strided) tensors are supported, got {t.layout}")


def check_device(alg, collective: str, t: torch.Tensor) -> None:
    if t.device.type not in alg.devices:
        raise UnsupportedError(f"commlab[{alg.name}]: tensors on {t.device.type} are not supported "
                               f"(this {collective} algorithm serves {', '.join(alg.devices)})")


class Plans:
    """The plan cache of one family: keyed by cheap values, bounded (ops built afresh for
    every call would each add one)."""

    MAX = 256

    def __init__(self, plan_class: type[Plan], registry, reduces: bool = False):
        self._plans: dict[tuple, Plan] = {}
        self.plan_class = plan_class
        self.registry = registry  # the family's registry (get, names)
        self.reduces = reduces  # whether its calls take an op (its key, its refusals)

    def plan(self, algorithm: str, group, like: torch.Tensor, *tensors, op=None) -> Plan:
        """The plan of a call on `tensors` (`like`: the one whose dtype and device key it and
        whose facts the algorithm judges), validated once from facts every rank shares, so
        a refusal is the same error on every rank before any traffic. The op is keyed by
        identity (hashing a ReduceOp costs more than a small shm call's transport,
        docs/measurements.md#figures-behind-the-codes-choices); the plan keeps it alive, so
        its id is not reused while cached, and an equal op of another identity just takes
        the long way."""
        collective = self.plan_class.collective
        check_tensors(collective, *tensors)
        ids = (id(op), id(group)) if self.reduces else (id(group),)
        key = key_of(algorithm, *ids, like.dtype, like.is_cpu, like.is_cuda)
        plan = self.get(key, op)
        if plan is not None:
            return plan
        alg = self.registry.get(algorithm)
        reduce_op = parse_op(op) if self.reduces else None
        if self.reduces and like.dtype not in SUPPORTED_DTYPES:
            names = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)
            raise UnsupportedError(f"commlab: {collective} of dtype {like.dtype} is not supported (supported: {names})")
        info = groups.resolve(group)
        check_device(alg, collective, like)
        facts = (like, Op.SUM if reduce_op is Op.AVG else reduce_op, info) if self.reduces else (like, info)
        reason = alg.unsupported(*facts)
        if reason:
            raise UnsupportedError(f"commlab[{alg.name}]: {reason}")
        plan = self.plan_class(alg, info, self.registry.names, reduce_op, op)
        # AVG divides after the exchange, in Python: only the long way does it.
        return self.put(key, plan, like, None if reduce_op is Op.AVG else (collective, algorithm, *ids))

    def __len__(self) -> int:
        return len(self._plans)

    def clear(self) -> None:
        """Forgets every plan of the family and every fast path (an environment a plan
        was made under has changed)."""
        self._plans.clear()
        _fast.clear()

    def get(self, key, op=None) -> Plan | None:
        plan = self._plans.get(key) if key is not None else None
        if plan is not None and plan.op_key is op and plan.info.alive():
            if plan.fast is not None:  # the fast path serves the latest dtype of its key
                _fast[plan.fast_key] = plan
            return plan
        return None

    def put(self, key, plan: Plan, t: torch.Tensor, fast_key: tuple) -> Plan:
        """Caches `plan` under `key`; `fast_key` is where the fast path will find it."""
        if key is not None and (t.is_cpu or t.is_cuda):  # other devices share a key: never cached
            if len(self._plans) >= self.MAX:
                self.clear()
            self._plans[key] = plan
            plan.fast_key = fast_key
        return plan


def key_of(*parts):
    """A cache key, or None where a part is unhashable (validation then explains)."""
    try:
        hash(parts)
    except TypeError:
        return None
    return parts
