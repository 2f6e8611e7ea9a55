"""The seed's table predicted for the modes that replicate the parameters: a training
step's operations timed on a hardware profile (hardware.py), DDP's buckets all-reduced
as their gradients become ready and overlapped with the rest of backward, DP's
parameter-server traffic through device 0's one link, and memory per device from the
step's own tensors. Every mode's row has compare's keys and "predicted": true (ZeRO-1's
and FSDP's: sharded.py)."""
from __future__ import annotations

from dataclasses import dataclass

from commlab.experiments.modes import Mode
from commlab.experiments.predict.graph import Op, Step, trace
from commlab.experiments.predict.hardware import (
    Profile,
    allreduce_us,
    in_training,
    op_times_us,
    wait_charged,
)

FIRST_BUCKET_BYTES = 1 << 20  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES: DDP's first bucket is small


@dataclass
class Setup:
    model: str
    world: int
    batch_size: int  # global
    bucket_cap_mb: float = 25.0
    # DDP given bucket_cap_mb (compare always gives it) makes its first bucket that size too
    # (torch's _BucketCapacityConfig); left to its default, the first is 1 MiB.
    bucket_cap_given: bool = False
    amp: str | None = None
    checkpoint: bool = False
    width: int = 1024
    depth: int = 4
    input_shape: tuple[int, ...] | None = None  # a factory model's sample shape (workloads.user_model)
    optimizer: str = "sgd"  # sgd | adamw (compare's --optimizer): what the optimizer step and its state cost
    accum_steps: int = 1  # micro-steps per optimizer step (compare's --accum-steps): each at batch / world / accum

    def micro_batch(self) -> int:
        """A micro-step's per-device batch, as compare splits it."""
        return max(1, max(1, self.batch_size // self.world) // max(self.accum_steps, 1))


class Steps:
    """Steps at any per-device batch from two traces, at the setup's micro-step batch b
    and at 2b (meta tensors: a trace costs the same at any batch). Every operation's
    FLOPs and bytes are affine in the batch, and so are the bytes alive after each op;
    the peak is the largest of those at the batch asked for."""

    def __init__(self, s: Setup):
        kw = dict(width=s.width, depth=s.depth, checkpoint=s.checkpoint, input_shape=s.input_shape,
                  optimizer=s.optimizer)
        self.b = s.micro_batch()
        self.one, self.two = trace(s.model, self.b, **kw), trace(s.model, 2 * self.b, **kw)
        if len(self.one.ops) != len(self.two.ops):
            raise ValueError(f"{s.model}: the traced step changes shape with the batch; cannot extrapolate")

    def at(self, b: int) -> Step:
        one, two = self.one, self.two

        def lin(a, c):
            return a + (b - self.b) / self.b * (c - a)

        ops = [Op(o.phase, lin(o.flops, t.flops), lin(o.bytes, t.bytes), o.kind) for o, t in zip(one.ops, two.ops)]
        # Each moment's live bytes are affine in the batch, the peak is their maximum: it
        # moves from the end of backward (gradients) to its start (activations) as b grows.
        live = [lin(x, y) for x, y in zip(one.live, two.live)] if len(one.live) == len(two.live) else []
        return Step(batch=b, ops=ops, params=one.params, grad_ready=one.grad_ready,
                    activation_bytes=lin(one.activation_bytes, two.activation_bytes),
                    peak_bytes=max(live) if live else lin(one.peak_bytes, two.peak_bytes),
                    input_bytes=lin(one.input_bytes, two.input_bytes), output_bytes=lin(one.output_bytes, two.output_bytes),
                    buffers_bytes=one.buffers_bytes, units=one.units, optimizer=one.optimizer)


def buckets(params: list[int], cap_mb: float, order: list[int] | None = None,
            first_bytes: int = FIRST_BUCKET_BYTES) -> list[list[int]]:
    """DDP's buckets after its first iteration (the reducer rebuilds them in the order
    gradients became ready): filled in `order` (default: reverse parameter order), a
    bucket closed once it reaches its limit, first_bytes for the first (1 MiB: DDP's
    default; the cap where DDP was given one, see Setup), bucket_cap_mb after (torch's
    compute_bucket_assignment_by_size)."""
    out, cur, size = [], [], 0
    for i in (order if order is not None else reversed(range(len(params)))):
        cur.append(i)
        size += params[i]
        if size >= (first_bytes if not out else cap_mb * 2**20):
            out.append(cur)
            cur, size = [], 0
    if cur:
        out.append(cur)
    return out


def ready_order(st: Step) -> list[int]:
    return sorted(range(len(st.params)), key=lambda i: (st.grad_ready.get(i, len(st.ops)), -i))


def step_times(s: Setup, prof: Profile, steps: Steps):
    """The per-device micro-step of a setup and its operations' times: (per-device batch,
    micro-step, per-op µs, one micro-step's forward and backward µs, the optimizer's)."""
    b = max(1, s.batch_size // s.world)
    st = steps.at(s.micro_batch())
    t = op_times_us(st, prof, s.amp, s.accum_steps)
    phase = {ph: sum(x for x, o in zip(t, st.ops) if o.phase == ph) for ph in ("fwd", "bwd", "opt")}
    return b, st, t, phase["fwd"], phase["bwd"], phase["opt"]


def shared_cores(ready: list[float], costs: list[float], compute_end: float) -> tuple[float, float]:
    """Where ranks outnumber cores, a rank's backward and its communication thread share
    the rank's part of the cores: while both run each goes at half its speed (processor
    sharing); the buckets go one at a time, each once compute has reached its ready point.
    Returns (when compute ends, when the last bucket ends): the first is backward slowed
    by what ran beside it, the difference the exposed part."""
    pending = sorted(zip((min(r, compute_end) for r in ready), costs))
    queue: list[float] = []  # the released buckets' remaining cost, in order
    t = work = 0.0
    compute_done = None
    i = 0
    while True:
        while i < len(pending) and pending[i][0] <= work + 1e-9:
            queue.append(pending[i][1])
            i += 1
        computing = work < compute_end - 1e-9
        if not computing and compute_done is None:
            compute_done = t
        if not computing and not queue:
            return compute_done, t
        rate = 0.5 if computing and queue else 1.0
        dt = min(([(min(pending[i][0] if i < len(pending) else compute_end, compute_end) - work) / rate]
                  if computing else []) + ([queue[0] / rate] if queue else []))
        if computing:
            work += dt * rate
        if queue:
            queue[0] -= dt * rate
            if queue[0] <= 1e-9:
                queue.pop(0)
        t += dt


def predict_ddp(mode: str, s: Setup, prof: Profile, steps: Steps) -> dict:
    p = s.world
    b, st, t, fwd, bwd, opt = step_times(s, prof, steps)
    done = [0.0]
    for x in t:
        done.append(done[-1] + x)
    m = Mode.parse(mode)
    algorithm = m.all_reduce or ("noop" if m.noop else None)
    total = exposed = waiting = slowed = exit_spread = 0.0
    first = int(s.bucket_cap_mb * 2**20) if s.bucket_cap_given else FIRST_BUCKET_BYTES
    bks = buckets(st.params, s.bucket_cap_mb, ready_order(st), first) if algorithm not in (None, "noop") else []
    if bks:
        ready = [max(done[st.grad_ready[i]] for i in bk) for bk in bks]
        costs = [allreduce_us(prof, algorithm, p, sum(st.params[i] for i in bk)) for bk in bks]  # fp32 grads
        total = sum(costs)
        if prof.overlap:  # a core of its own: communication runs beside backward at full speed
            end = 0.0
            for r, c in zip(ready, costs):
                end = max(r, end) + c
            exposed = max(0.0, end - (fwd + bwd))
        else:
            compute_end, end = shared_cores(ready, costs, fwd + bwd)
            slowed, exposed = compute_end - (fwd + bwd), end - compute_end
        # What is left after backward is called after compute, the ranks arriving apart (this
        # host's probe): longer than the bench's back-to-back calls, and the ranks leave it apart.
        factor, spread, _ = in_training(prof, "all_reduce", algorithm, p)
        total += exposed * (factor - 1)
        exposed *= factor
        exit_spread = exposed * spread
    # Accumulation: the micro-steps before the last run under no_sync, without a bucket.
    earlier = (s.accum_steps - 1) * (fwd + bwd)
    it = earlier + fwd + bwd + slowed + exposed + opt
    busy = 100.0 * (earlier + fwd + bwd + opt + exposed) / it
    wait_ms, wait_se = wait_charged(prof)
    if total:
        # A rank that ends backward early waits for the last: compare reports the busiest
        # rank's sync, so that wait is in it; the iteration (the slowest rank's) already
        # holds it in the measured compute.
        waiting = wait_ms * 1e3 + exit_spread  # the last bucket's exit spread: where the next step's drift starts
        total += waiting
        exposed += waiting
    info = {"forward_ms": fwd / 1e3, "backward_ms": bwd / 1e3, "optimizer_ms": opt / 1e3,
            "buckets": len(bks), **({"backward_slowed_by_sync_ms": slowed / 1e3} if slowed else {}),
            "per_device_batch": b, **micro(s)}
    # compare's tensor bytes: parameters, gradients, DDP's bucket copies of them
    # (gradient_as_bucket_view=False; the reducer holds them in every DDP mode), optimizer state.
    held = {"parameters": st.param_bytes, "gathered": 0, "gradients": st.param_bytes,
            "optimizer_state": state_bytes(st), "buckets": st.param_bytes}
    comm = st.param_bytes if bks else 0
    if prof.device == "cpu":  # compare reports peak RSS (interpreter and torch too) and CPU time: not modelled
        return row(mode, s, it, [None] * p, [None] * p, total, exposed, info, held, comm, waiting,
                    wait_se)
    # Weights, the step's peak of everything else (activations, gradients, temporaries), the
    # input batch, DDP's bucket copies of the gradients and the optimizer's state.
    mem = st.param_bytes + st.buffers_bytes + st.peak_bytes + st.input_bytes + (st.param_bytes if bks else 0) \
        + state_bytes(st)
    return row(mode, s, it, [mem] * p, [busy] * p, total, exposed, info, held, comm, waiting, wait_se)


def predict_dp(s: Setup, prof: Profile, steps: Steps) -> dict:
    if prof.device != "cuda":
        return {"mode": "dp", "status": "unavailable", "predicted": True,
                "reason": "nn.DataParallel replicates a module across CUDA devices; this profile has none"}
    p = s.world
    b, st, _, fwd, bwd, opt = step_times(s, prof, steps)
    link = prof.link
    per_us = link["gbps"] * 1e3
    lat = link["call_latency_us"] + (p - 1) * link["step_latency_us"]
    batch_in, batch_out = st.input_bytes * p, st.output_bytes * p
    scatter = (p - 1) / p * batch_in / per_us  # device 0 sends every other device its share, over its one link
    replicate = lat + (st.param_bytes + st.buffers_bytes) / per_us  # broadcast from device 0, every iteration
    gather = (p - 1) / p * batch_out / per_us
    reduce = lat + st.param_bytes / per_us + st.param_bytes * 3 / (prof.memory_bandwidth_gbps * 1e3)
    # Every micro-step scatters, replicates, gathers and reduces again; all on the compute stream.
    comm = s.accum_steps * (scatter + replicate + gather + reduce)
    it = comm + s.accum_steps * (fwd + bwd) + opt
    # Every device: a replica's parameters and buffers (device 0's are the module's own), the step's peak
    # of everything else, its inputs; device 0 also the leaf gradients the replicas' are reduced into, the
    # whole batch it scatters and the outputs it gathers.
    replica = st.param_bytes + st.buffers_bytes + st.peak_bytes + st.input_bytes
    main = replica + st.param_bytes + batch_in + batch_out
    # the others idle while device 0 scatters, gathers, steps
    busy = 100.0 * s.accum_steps * (replicate + fwd + bwd + reduce) / it
    return row("dp", s, it, [main] + [replica] * (p - 1), [100.0] + [busy] * (p - 1), comm, comm,
                {"forward_ms": fwd / 1e3, "backward_ms": bwd / 1e3, "optimizer_ms": opt / 1e3,
                 "scatter_ms": scatter / 1e3, "replicate_ms": replicate / 1e3, "gather_ms": gather / 1e3,
                 "reduce_ms": reduce / 1e3, "per_device_batch": b, **micro(s)})


def micro(s: Setup) -> dict:
    """The breakdown's note of accumulation: forward_ms and backward_ms are then one micro-step's."""
    return {"micro_steps": s.accum_steps, "micro_batch": s.micro_batch()} if s.accum_steps > 1 else {}


STATE_PER_PARAM_BYTE = {"sgd": 0.0, "adamw": 2.0}  # AdamW keeps exp_avg and exp_avg_sq, each a parameter's size


def state_bytes(st: Step) -> float:
    return STATE_PER_PARAM_BYTE[st.optimizer] * st.param_bytes


def row(mode, s, it_us, mem, util, total_us, exposed_us, breakdown, held=None, comm_bytes=None,
         waiting_us: float = 0.0, waiting_se_ms: float | None = None) -> dict:
    """waiting_us: the part of exposed_us charged for waiting on the last rank (compare's
    exposed sync after the last rank's arrival is the rest); waiting_se_ms: its standard error."""
    row = {"mode": mode, "status": "ok", "reason": "", "predicted": True,
           "iter_ms": {"median": it_us / 1e3, "p90": it_us / 1e3},
           "samples_per_s": s.batch_size / (it_us / 1e6),
           "peak_memory_mb": [None if m is None else m / 2**20 for m in mem], "util_percent": util,
           "grad_sync_ms": {"total": total_us / 1e3, "exposed": exposed_us / 1e3,
                            "after_arrival": (exposed_us - waiting_us) / 1e3,
                            **({"exposed_se": waiting_se_ms} if waiting_us and waiting_se_ms is not None else {})},
           "final_loss": None, "breakdown": breakdown}
    if held is not None:  # compare's tensor-bytes row: what each rank holds at its peak, by category
        row["tensor_mb"] = sum(held.values()) / 2**20
        row["tensor_breakdown_mb"] = {k: v / 2**20 for k, v in held.items()}
        row["comm_mb"] = comm_bytes / 2**20
    return row
