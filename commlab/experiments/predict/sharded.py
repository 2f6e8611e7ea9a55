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


class _FsdpStep:
    """One FSDP step followed op by op on a Timeline: the collectives each block needs, when
    they are issued and done, and the tensor bytes held meanwhile (Held)."""

    def __init__(self, mode: str, p: int, st: Step, t: list[float], prof, collective_us, reused: bool):
        m = Mode.parse(mode)
        self.p, self.st, self.t, self.reshard = p, st, t, m.reshard
        self.blocks, root = [u for u in st.units[:-1] if u.params], st.units[-1]
        self.size = [sum(st.params[i] for i in u.params) for u in self.blocks]
        self.root_bytes = sum(st.params[i] for i in root.params)
        self.n_fwd = sum(1 for o in st.ops if o.phase == "fwd")
        self.n_bwd = self.n_fwd + sum(1 for o in st.ops if o.phase == "bwd")
        # A block's gradients complete at this op.
        ready = [max(st.grad_ready.get(i, self.n_bwd) for i in u.params) for u in self.blocks]
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
        self.prof, self.algorithm, self.cost = prof, m.collectives, collective_us
        self.slow = {c: in_training(prof, c, m.collectives, p, reused=reused) for c in ("all_gather", "reduce_scatter")}
        self.exits = 0.0  # the exit spreads summed over the step's calls: where each next wait starts from
        self.tl, self.held, self.comm = Timeline(prof.overlap), Held(), 0.0
        state = {"sgd": 0.0, "adamw": 2.0}[st.optimizer] * st.param_bytes
        self.held.add("parameters", st.param_bytes / p, -1.0)
        self.held.add("optimizer_state", state / p, -1.0)
        self.held.add("gradients", st.param_bytes / p, -1.0, 0.0)  # the last step's shards, until zero_grad
        self.grads_from: dict[int, float] = {}  # a unit's full gradients, from its first micro-step's backward
        self.rs_end: dict[int, float] = {}
        self.starts = {u.fwd[0]: k for k, u in enumerate(self.blocks)}
        self.ends = {u.fwd[1]: k for k, u in enumerate(self.blocks)}
        self.prefetch = prof.overlap  # FSDP2 issues the next block's all-gather early only where it has streams
        bwd_start = {k: (ready[k + 1] if k + 1 < len(self.blocks) else self.n_fwd) for k in range(len(self.blocks))}
        self.at_op: dict[int, list[int]] = {}
        for k in sorted(range(len(self.blocks)), key=lambda k: bwd_start[k]):
            self.at_op.setdefault(bwd_start[k], []).append(k)
        self.done_at: dict[int, list[int]] = {}
        for k in range(len(self.blocks)):
            self.done_at.setdefault(ready[k], []).append(k)

    def _call(self, collective: str, n: float) -> float:
        factor, spread, _ = self.slow[collective]
        us = self.cost(self.prof, collective, self.algorithm, self.p, n) * factor
        self.exits += us * spread
        return us

    def _faults(self, collective: str, n: float) -> float:
        return 0.0 if self.slow[collective][2] else first_touch_us(self.prof, n)

    def ag(self, n: float) -> tuple[float, float]:
        return (self._call("all_gather", n) + self._faults("all_gather", n), copy_us(self.prof, 2 * (n / self.p + n)))

    def rs(self, n: float) -> tuple[float, float]:
        return (self._call("reduce_scatter", n) + self._faults("reduce_scatter", n / self.p),
                copy_us(self.prof, 2 * (n + n / self.p)))

    def _reduce_scatter(self, k: int, n: float) -> None:
        """Unit k's full gradients (n bytes) held from their first backward until reduced, then its shard."""
        _, end = self.tl.collective(self.tl.compute, self.rs(n))
        self.rs_end[k] = end
        self.held.add("gradients", n, self.grads_from[k], end)
        self.held.add("gradients", n / self.p, end)

    def forward(self) -> None:
        """The root gathered first, then each block before its first op (the next one issued
        early where collectives overlap compute)."""
        tl = self.tl
        if self.root_bytes:
            _, end = tl.collective(tl.compute, self.ag(self.root_bytes))
            self.comm += self.root_bytes
            tl.wait(end)
        self.gathered_end = [0.0] * len(self.blocks)  # when each block's forward-gathered parameters are freed
        self.ag_fwd: dict[int, tuple[float, float]] = {}  # block -> (issued, done)
        for i in range(self.n_fwd):
            if i in self.ends:
                self.gathered_end[self.ends[i]] = tl.compute
            if i in self.starts:
                k = self.starts[i]
                self._gather(self.ag_fwd, k, tl.compute)
                tl.wait(self.ag_fwd[k][1])
                if self.prefetch:
                    self._gather(self.ag_fwd, k + 1, tl.compute)
            tl.run(self.t[i])
        for k in range(len(self.blocks)):
            self.comm += self.size[k]
            if not self.gathered_end[k]:
                self.gathered_end[k] = tl.compute

    def _gather(self, into: dict, k: int, at: float) -> None:
        if 0 <= k < len(self.blocks) and k not in into:
            into[k] = (at, self.tl.collective(at, self.ag(self.size[k]))[1])

    def backward(self, last: bool) -> None:
        """Blocks in reverse: each needs its parameters (gathered again if resharded) before
        its first op, the previous block's gathered at its start (prefetch); its gradients
        reduce-scattered once complete on the last micro-step."""
        tl = self.tl
        self.ag_bwd: dict[int, tuple[float, float]] = {}
        self.begun: dict[int, float] = {}
        for i in range(self.n_fwd, self.n_bwd + 1):
            for k in self.done_at.get(i, []):
                self._finish(k, last)
            if i == self.n_bwd:
                break
            for k in self.at_op.get(i, []):
                if self.reshard:
                    self._gather(self.ag_bwd, k, tl.compute)
                tl.wait(self.ag_bwd[k][1] if self.reshard else 0.0)
                self.begun[k] = tl.compute
                if self.reshard:
                    self._gather(self.ag_bwd, k - 1, tl.compute)
            tl.run(self.t[i])
        for k in range(len(self.blocks)):  # blocks whose gradients the trace never saw complete
            if k not in self.begun:
                self.begun[k] = tl.compute
                self._finish(k, last)
        self.comm += sum(self.size) if self.reshard else 0  # backward's gathers

    def _finish(self, k: int, last: bool) -> None:
        """A block's gradients complete: reduce-scatter (last micro-step), reshard."""
        self.grads_from.setdefault(k, self.begun[k])
        if last:
            self._reduce_scatter(k, self.size[k])
        if self.reshard:
            self.held.add("gathered", self.size[k], self.ag_bwd[k][0], self.tl.compute)
            self.held.add("gathered", self.size[k], self.ag_fwd[k][0], self.gathered_end[k])
        else:
            self.held.add("gathered", self.size[k], self.ag_fwd[k][0], self.tl.compute)

    def run(self, accum: int) -> tuple[float, dict, float, dict]:
        tl = self.tl
        for micro in range(accum):
            # Accumulation: every micro-step gathers again (FSDP2 reshards after backward), only
            # the last reduce-scatters; the full gradients stay until then (set_requires_gradient_sync).
            last = micro == accum - 1
            step_start = tl.compute
            self.forward()
            fwd_done = tl.compute
            self.backward(last)
            if self.root_bytes:
                self.grads_from.setdefault(-1, fwd_done)
                self.held.add("gathered", self.root_bytes, step_start, tl.compute)
                if last:
                    self._reduce_scatter(-1, self.root_bytes)
                    self.comm += self.root_bytes
        self.comm += sum(self.size)  # the reduce-scatters
        tl.wait(max(self.rs_end.values(), default=0.0))  # FSDP2 waits for every reduce-scatter before the step
        opt = sum(x for x, o in zip(self.t, self.st.ops) if o.phase == "opt") / self.p  # the optimizer steps the shards
        tl.run(opt)
        return tl.compute, self.held.peak(), self.comm, {
            "optimizer_ms": opt / 1e3, "units": len(self.blocks) + bool(self.root_bytes),
            "largest_unit_mb": max(self.size, default=0) / 2**20, "comm_us": tl.comm_us, "exit_spread_us": self.exits}


def _fsdp(mode: str, p: int, st: Step, t: list[float], prof, collective_us,
          accum: int = 1, reused: bool = False) -> tuple[float, dict, float, dict]:
    """One FSDP step of `accum` micro-steps (t: one micro-step's op times): (iteration µs,
    tensor bytes at the peak, bytes communicated, schedule facts). reused: every call's
    output recycled by the allocator, as this host's probe timed it (else mapped afresh)."""
    return _FsdpStep(mode, p, st, t, prof, collective_us, reused).run(accum)


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

