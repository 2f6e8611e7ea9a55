"""ZeRO-1 and FSDP predicted, with compare's modes and keys.

- `zero1`: DDP's buckets as `ddp` (all-reduced as gradients become ready), the
  optimizer stepping 1/p of the parameters (on this host as its probe timed every rank
  stepping its own at once, the broadcasts waiting for the slowest), then every parameter
  broadcast from the rank that owns it (torch's ZeroRedundancyOptimizer).
- `fsdp`, `fsdp:<algorithm>`, `fsdp:noreshard`: FSDP2 with `fully_shard` per block and on
  the root. One schedule of a step: the root gathered first and kept to the end of
  backward; each block all-gathered before its forward (issued one block ahead where
  collectives overlap compute, as FSDP2's streams do on a GPU; on demand where they do
  not), resharded after it unless noreshard, gathered again before its backward (the
  next block's prefetched at each block's backward, FSDP2's default), its gradients
  reduce-scattered as soon as they are complete; the optimizer steps the shards after
  the last reduce-scatter. Collectives run one at a time on the link, compute one op at
  a time, each waiting for what it needs; where ranks outnumber cores nothing overlaps.

Memory is compare's tensor bytes followed through that schedule (parameters or their
shards, gathered units, full gradients of a unit until its reduce-scatter ends, the
gradient shards, optimizer state, DDP's buckets), its peak reported with the breakdown
at that moment; on a GPU the step's activations and the input are added."""
from __future__ import annotations

from commlab import algorithms
from commlab.experiments.modes import Mode
from commlab.experiments.predict import hardware, replicated
from commlab.experiments.predict.graph import Step
from commlab.experiments.predict.hardware import (
    collective_us,
    copy_us,
    first_touch_us,
    in_training,
)
from commlab.measure.syncprobe import OPTIMIZERS, ZERO1

# ZeroRedundancyOptimizer's broadcasts: gloo's (binomial) on CPU; NCCL's pipelined ring on a GPU, the chain's formula.
BROADCAST = {"cpu": "builtin", "cuda": "chain"}


class Timeline:
    """Compute ops on one clock, collectives on another (the link), or both on one
    where they cannot overlap."""

    def __init__(self, overlap: bool):
        self.overlap, self.compute, self.link, self.comm_us = overlap, 0.0, 0.0, 0.0

    def collective(self, issued_at: float, cost: tuple[float, float]) -> tuple[float, float]:
        """cost: (the collective, the copies around it) in µs; comm_us counts the first,
        as compare times the call."""
        start = max(self.link, issued_at) if self.overlap else max(self.link, issued_at, self.compute)
        end = start + sum(cost)
        self.link, self.comm_us = end, self.comm_us + cost[0]
        if not self.overlap:
            self.compute = end
        return start, end

    def wait(self, until: float) -> None:
        self.compute = max(self.compute, until)

    def run(self, us: float) -> None:
        self.compute += us
        if not self.overlap:
            self.link = self.compute


class Held:
    """Tensor bytes as intervals [start, end) by category; the peak is at some interval's start."""

    def __init__(self):
        self.spans: list[tuple[float, float, str, float]] = []

    def add(self, category: str, nbytes: float, start: float, end: float = float("inf")) -> None:
        if nbytes:
            self.spans.append((start, end, category, nbytes))

    def peak(self) -> dict:
        best, at = -1.0, {}
        for t in sorted({s for s, _, _, _ in self.spans}):
            got = {"parameters": 0.0, "gathered": 0.0, "gradients": 0.0, "optimizer_state": 0.0, "buckets": 0.0}
            for s, e, c, n in self.spans:
                if s <= t < e:
                    got[c] += n
            if sum(got.values()) > best:
                best, at = sum(got.values()), got
        return at


def _fsdp(mode: str, p: int, st: Step, t: list[float], prof, collective_us,
          accum: int = 1, reused: bool = False) -> tuple[float, dict, float, dict]:
    """One FSDP step of `accum` micro-steps (t: one micro-step's op times): (iteration µs,
    tensor bytes at the peak, bytes communicated, schedule facts). reused: every call's
    output recycled by the allocator, as this host's probe timed it (else mapped afresh)."""
    m = Mode.parse(mode)
    algorithm, reshard = m.collectives, m.reshard
    blocks, root = [u for u in st.units[:-1] if u.params], st.units[-1]
    size = [sum(st.params[i] for i in u.params) for u in blocks]
    root_bytes = sum(st.params[i] for i in root.params)
    n_fwd = sum(1 for o in st.ops if o.phase == "fwd")
    n_bwd = n_fwd + sum(1 for o in st.ops if o.phase == "bwd")
    ready = [max(st.grad_ready.get(i, n_bwd) for i in u.params) for u in blocks]  # a block's gradients complete

    # FSDP2 copies around each collective: the shard into the all-gather input and the
    # output out to the parameters (u/p + u, each read and written); the gradients into
    # the reduce-scatter input and the result out to the shard (u + u/p).
    # On a host FSDP allocates each call's output fresh and the call writes it first: page
    # faults the bench, reusing its buffers, never paid, where the allocator maps the output
    # afresh (glibc: above its mmap threshold; a GPU's caching allocator: never).
    # Called after compute, as training calls them: this host's probe gives how much longer
    # a call takes than the bench's back-to-back one, and how far apart the ranks leave it;
    # its calls write buffers as FSDP2's do (allocated for the call, or recycled where reused),
    # so their page faults are in that ratio.
    slow = {c: in_training(prof, c, algorithm, p, reused=reused) for c in ("all_gather", "reduce_scatter")}
    faults = lambda c, n: 0.0 if slow[c][2] else first_touch_us(prof, n)  # noqa: E731
    exits = [0.0]  # the exit spreads summed over the step's calls: where each next wait starts from

    def call(collective: str, n: float) -> float:
        factor, spread, _ = slow[collective]
        us = collective_us(prof, collective, algorithm, p, n) * factor
        exits[0] += us * spread
        return us

    ag = lambda n: (call("all_gather", n) + faults("all_gather", n), copy_us(prof, 2 * (n / p + n)))  # noqa: E731
    rs = lambda n: (call("reduce_scatter", n) + faults("reduce_scatter", n / p),  # noqa: E731
                    copy_us(prof, 2 * (n + n / p)))
    tl, held, comm = Timeline(prof.overlap), Held(), 0.0
    state = {"sgd": 0.0, "adamw": 2.0}[st.optimizer] * st.param_bytes
    held.add("parameters", st.param_bytes / p, -1.0)
    held.add("optimizer_state", state / p, -1.0)
    held.add("gradients", st.param_bytes / p, -1.0, 0.0)  # the last step's shards, until zero_grad
    grads_from: dict[int, float] = {}  # a unit's full gradients, from its first micro-step's backward
    rs_end: dict[int, float] = {}
    starts = {u.fwd[0]: k for k, u in enumerate(blocks)}
    ends = {u.fwd[1]: k for k, u in enumerate(blocks)}
    prefetch = prof.overlap  # FSDP2 issues the next block's all-gather early only where it has streams
    bwd_start = {k: (ready[k + 1] if k + 1 < len(blocks) else n_fwd) for k in range(len(blocks))}
    at_op: dict[int, list[int]] = {}
    for k in sorted(range(len(blocks)), key=lambda k: bwd_start[k]):
        at_op.setdefault(bwd_start[k], []).append(k)
    done_at: dict[int, list[int]] = {}
    for k in range(len(blocks)):
        done_at.setdefault(ready[k], []).append(k)
    for micro in range(accum):
        # Accumulation: every micro-step gathers again (FSDP2 reshards after backward), only
        # the last reduce-scatters; the full gradients stay until then (set_requires_gradient_sync).
        last = micro == accum - 1
        step_start = tl.compute
        # Forward: the root first, then each block gathered before its first op.
        if root_bytes:
            _, end = tl.collective(tl.compute, ag(root_bytes))
            comm += root_bytes
            tl.wait(end)
        gathered_end = [0.0] * len(blocks)  # when each block's forward-gathered parameters are freed
        ag_fwd: dict[int, tuple[float, float]] = {}  # block -> (issued, done)

        def gather_fwd(k: int, at: float) -> None:
            if k < len(blocks) and k not in ag_fwd:
                ag_fwd[k] = (at, tl.collective(at, ag(size[k]))[1])

        for i in range(n_fwd):
            if i in ends:
                gathered_end[ends[i]] = tl.compute
            if i in starts:
                k = starts[i]
                gather_fwd(k, tl.compute)
                tl.wait(ag_fwd[k][1])
                if prefetch:
                    gather_fwd(k + 1, tl.compute)
            tl.run(t[i])
        for k in range(len(blocks)):
            comm += size[k]
            if not gathered_end[k]:
                gathered_end[k] = tl.compute
        fwd_done = tl.compute
        # Backward: blocks in reverse; each needs its parameters (gathered again if resharded)
        # before its first op, the previous block's gathered at its start (prefetch).
        ag_bwd: dict[int, tuple[float, float]] = {}
        begun: dict[int, float] = {}

        def gather_bwd(k: int, at: float) -> None:
            if reshard and 0 <= k and k not in ag_bwd:
                ag_bwd[k] = (at, tl.collective(at, ag(size[k]))[1])

        def finish(k: int) -> None:  # a block's gradients complete: reduce-scatter (last micro-step), reshard
            grads_from.setdefault(k, begun[k])
            if last:
                _, end = tl.collective(tl.compute, rs(size[k]))
                rs_end[k] = end
                held.add("gradients", size[k], grads_from[k], end)  # the unit's full gradients until reduced
                held.add("gradients", size[k] / p, end)
            if reshard:
                held.add("gathered", size[k], ag_bwd[k][0], tl.compute)
                held.add("gathered", size[k], ag_fwd[k][0], gathered_end[k])
            else:
                held.add("gathered", size[k], ag_fwd[k][0], tl.compute)

        for i in range(n_fwd, n_bwd + 1):
            for k in done_at.get(i, []):
                finish(k)
            if i == n_bwd:
                break
            for k in at_op.get(i, []):
                gather_bwd(k, tl.compute)
                tl.wait(ag_bwd[k][1] if reshard else 0.0)
                begun[k] = tl.compute
                gather_bwd(k - 1, tl.compute)
            tl.run(t[i])
        for k in range(len(blocks)):  # blocks whose gradients the trace never saw complete
            if k not in begun:
                begun[k] = tl.compute
                finish(k)
        comm += sum(size) if reshard else 0  # backward's gathers
        if root_bytes:
            grads_from.setdefault(-1, fwd_done)
            held.add("gathered", root_bytes, step_start, tl.compute)
            if last:
                _, end = tl.collective(tl.compute, rs(root_bytes))
                rs_end[-1] = end
                held.add("gradients", root_bytes, grads_from[-1], end)
                held.add("gradients", root_bytes / p, end)
                comm += root_bytes
    comm += sum(size)  # the reduce-scatters
    tl.wait(max(rs_end.values(), default=0.0))  # FSDP2 waits for every reduce-scatter before the step
    opt = sum(x for x, o in zip(t, st.ops) if o.phase == "opt") / p  # the optimizer steps the shards
    tl.run(opt)
    return tl.compute, held.peak(), comm, {"optimizer_ms": opt / 1e3, "units": len(blocks) + bool(root_bytes),
                                          "largest_unit_mb": max(size, default=0) / 2**20, "comm_us": tl.comm_us,
                                          "exit_spread_us": exits[0]}


def zero1_broadcasts_us(prof, p: int, params: list[float]) -> tuple[float, float]:
    """(ZeRO-1's broadcasts of every parameter from its owner after the step, µs; how far
    apart the ranks leave them, µs): each call at the broadcast's cost, one after another;
    on this host, scaled to what its probe (measure.syncprobe's ZeRO-1 phase: torch's
    broadcasts issued asynchronously, gloo's worker threads (two by default) taking them
    in turn, and waited for together) timed after compute against that cost for the
    parameters it broadcast."""

    alg = BROADCAST[prof.device]
    factor, spread, _ = in_training(prof, ZERO1, alg, p, "broadcast")
    us = factor * sum(collective_us(prof, "broadcast", alg, p, n) for n in params)
    return us, us * spread


def zero1_optimizer_us(prof, p: int, opt_us: float) -> tuple[float, float, float | None]:
    """(ZeRO-1's optimizer step on the step's critical path, µs; the wait it leaves at the
    broadcasts after it, µs; that wait's standard error, ms): every rank steps its 1/p of
    the parameters at once, lined up by the buckets' all-reduce, and the broadcasts wait
    for the slowest. On this host as its probe (measure.syncprobe's ZeRO-1 phase with the
    optimizer's step) timed that phase — where ranks outnumber cores they reach the
    broadcasts far apart (docs/measurements.md#figures-behind-the-codes-choices); else
    1/p of the optimizer, nobody waiting (a hardware profile: a device per rank)."""
    got = prof.in_training.get(ZERO1, {}).get(BROADCAST[prof.device]) or {}
    if got.get("state") not in OPTIMIZERS:  # probed after fixed work, not the step
        return opt_us / p, 0.0, None
    return got["work_to_last_us"], got["wait_mean_us"], got.get("wait_mean_se_us", 0.0) / 1e3


def predict(mode: str, s, prof, steps) -> dict:
    p = s.world
    m = Mode.parse(mode)
    if m.kind == "fsdp" and m.algorithm:
        alg = m.collectives
        for family in ("all_gather", "reduce_scatter"):
            if alg not in algorithms.registry(family).names():
                raise ValueError(f"no {family} algorithm {alg!r}")
    b, st, t, fwd, bwd, opt = replicated.step_times(s, prof, steps)
    state = replicated.state_bytes(st)
    compute = s.accum_steps * (fwd + bwd)
    if mode == "zero1":
        ddp = replicated.predict_ddp("ddp", s, prof, steps)
        ddp_it, ddp_total, ddp_exposed = (ddp["iter_ms"]["median"] * 1e3, ddp["grad_sync_ms"]["total"] * 1e3,
                                          ddp["grad_sync_ms"]["exposed"] * 1e3)
        # Every parameter broadcast from its owner after the step: one call each, blocking;
        # on this host as its probe of them all, issued and waited for together, timed them.
        bcast, spread = zero1_broadcasts_us(prof, p, st.params)
        stepping, opt_wait, opt_se = zero1_optimizer_us(prof, p, opt)
        it = ddp_it - opt + stepping + bcast
        # DDP's wait is the drift from one end of backward to the next, its optimizer step
        # between; ZeRO-1's ranks drift from the step's start to the buckets, and again
        # through their shards' optimizer step to the broadcasts, which line them up.
        ddp_waiting = ddp["grad_sync_ms"]["exposed"] * 1e3 - ddp["grad_sync_ms"]["after_arrival"] * 1e3
        wait_ms, wait_se = hardware.wait_charged(prof, "step_start")
        if opt_se is not None:
            wait_se = ((wait_se or 0.0) ** 2 + opt_se ** 2) ** 0.5
        waiting = wait_ms * 1e3 + opt_wait + spread if ddp_waiting else 0.0  # no buckets, no wait (as DDP's)
        total, exposed = ddp_total - ddp_waiting + waiting + bcast, ddp_exposed - ddp_waiting + waiting + bcast
        held = {"parameters": st.param_bytes, "gathered": 0.0, "gradients": st.param_bytes,
                "optimizer_state": state / p, "buckets": st.param_bytes}
        comm = 2 * st.param_bytes
        info = {"forward_ms": fwd / 1e3, "backward_ms": bwd / 1e3, "optimizer_ms": stepping / 1e3,
                "broadcast_ms": bcast / 1e3, "per_device_batch": b, **replicated.micro(s)}
    else:
        drift, wait_se = hardware.wait_charged(prof, "fe" if mode == "fsdp:noreshard" else "fbe")

        def step(reused: bool) -> tuple:
            it, held, comm, facts = _fsdp(mode, p, st, t, prof, hardware.collective_us, s.accum_steps, reused)
            total = facts.pop("comm_us")
            exposed = min(total, it - compute - facts["optimizer_ms"] * 1e3)  # the copies are not the collectives'
            # As predict_ddp, a rank that reaches a collective first waits there for the last; FSDP
            # synchronises at every unit, the ranks drifting apart between units (ddp:noop's marks)
            # and leaving each call apart (the probe's exit spread).
            waiting = drift * 1e3 + facts.pop("exit_spread_us")
            return it, held, comm, facts, total + waiting, exposed + waiting, waiting

        it, held, comm, facts, total, exposed, waiting = step(False)
        info = {"forward_ms": fwd / 1e3, "backward_ms": bwd / 1e3, **facts, "per_device_batch": b, **replicated.micro(s)}
        algorithm = Mode.parse(mode).collectives
        if any(prof.in_training.get(c, {}).get(algorithm, {}).get("reused") for c in ("all_gather", "reduce_scatter")):
            # Whether an output is mapped afresh or recycled is the allocator's state at that
            # moment, which nothing before the run tells: the middle of the two states, their
            # range in the standard error (a mixture anywhere in it: half the range over √3);
            # allocator_range_ms lists [recycled, mapped afresh].
            it_r, _, _, _, total_r, exposed_r, waiting_r = step(True)
            info["allocator_range_ms"] = {"iteration": [it_r / 1e3, it / 1e3], "exposed": [exposed_r / 1e3, exposed / 1e3]}
            half = (exposed - exposed_r) / 2e3
            it, total, exposed, waiting = ((it + it_r) / 2, (total + total_r) / 2, (exposed + exposed_r) / 2,
                                           (waiting + waiting_r) / 2)
            wait_se = ((wait_se or 0.0) ** 2 + half ** 2 / 3) ** 0.5
    busy = 100.0  # as predict_ddp's: NVML counts a collective's kernels as busy, and nothing else waits
    if prof.device == "cpu":
        return replicated.row(mode, s, it, [None] * p, [None] * p, total, exposed, info, held, comm, waiting, wait_se)
    # On a GPU: what the step itself allocates beyond parameters and gradients
    # (activations, temporaries) and the input, beside the tensors held.
    # Activations and temporaries: what forward saves, or more where backward holds more at
    # once (checkpointing recomputes them there): the traced peak less the full gradients it counted.
    acts = max(st.activation_bytes, st.peak_bytes - st.param_bytes)
    mem = sum(held.values()) + acts + st.input_bytes + st.buffers_bytes
    return replicated.row(mode, s, it, [mem] * p, [busy] * p, total, exposed, info, held, comm, waiting, wait_se)

