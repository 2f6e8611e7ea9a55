"""The processes of a compare mode: one DDP rank (its own process group, the mode's hook,
timed training steps) and the DataParallel process. Both return plain data."""
from __future__ import annotations

import contextlib
import os
import time
import warnings

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from commlab.experiments import workloads
from commlab.experiments.compare import metrics, report
from commlab.experiments.compare.sharded import (
    ddp_bucket_bytes,
    measure_step,
    optimizer,
)
from commlab.experiments.compare.steps import (
    RankResult,
    across_ranks,
    optimizer_step,
    peak_memory_mb,
    start_rank,
    timed_default_hook,
    timed_micro_batch,
    timed_optimizer_step,
    timed_steps,
    warm_up,
)
from commlab.experiments.modes import Mode
from commlab.measure import trace
from commlab.training import hooks


def arrival_hook(log, bucket):
    """ddp:noop's hook: no communication, each bucket's arrival noted from the start of
    its rank's iteration (without a collective the ranks drift apart freely, so their
    clocks are not compared; a synchronising DDP starts them together)."""
    log["times"].append((log["iteration"], bucket.index(), time.perf_counter() - log["start"]))
    return hooks.noop_hook(None, bucket)


def synchronised_arrivals(offsets: list[float], cores: int) -> list[float]:
    """When each rank reaches a synchronisation, given how far behind the first it reaches
    it when no rank ever waits (offsets, s): ranks outnumbering cores share them (each
    min(1, cores/ranks) of one), and a rank that arrived sleeps in the collective, so the
    ones still computing split its core — processor sharing, as predict's shared cores."""
    n, first = len(offsets), min(offsets)
    work = {r: (o - first) * min(1.0, cores / n) for r, o in enumerate(offsets)}  # core-seconds behind
    arrived = {r: 0.0 for r, w in work.items() if w <= 0}
    t = 0.0
    while len(arrived) < n:
        running = [r for r in work if r not in arrived]
        rate = min(1.0, cores / len(running))
        nxt = min(running, key=lambda r: work[r])
        dt = work[nxt] / rate
        t += dt
        for r in running:
            work[r] -= dt * rate
            if r == nxt or work[r] <= 1e-12:
                arrived[r] = t
    return [arrived[r] for r in range(n)]


def _ends(logs: list[list], starts: list[dict] | None = None) -> dict[int, dict[int, float]]:
    """iteration -> rank -> its last bucket's hand-over (s after its own start); with starts
    (per rank: iteration -> its start, s on the host's clock), s after the rank's previous
    hand-over instead, for the iterations whose previous one is in the log."""
    ends: dict[int, dict[int, float]] = {}
    for rank, log in enumerate(logs):
        for i, _bucket, t in log:
            mine = ends.setdefault(i, {})
            mine[rank] = max(t, mine.get(rank, 0.0))
    if starts is None:
        return ends
    since: dict[int, dict[int, float]] = {}
    for i, mine in ends.items():
        for rank, t in mine.items():
            before = ends.get(i - 1, {}).get(rank)
            if before is not None:
                since.setdefault(i, {})[rank] = starts[rank][i] + t - (starts[rank][i - 1] + before)
    return since


def backward_ends_ms(logs: list[list]) -> list[float]:
    """Per timed iteration, the latest rank's end of backward after its own start (ddp:noop)."""
    return [max(d.values()) * 1e3 for _i, d in sorted(_ends(logs).items())]


def arrival_skew_ms(logs: list[list], cores: int, se: bool = False, starts: list[dict] | None = None) -> float | None:
    """The waiting for the last rank a synchronising mode's table would show, predicted from
    the compute-only step (ddp:noop, whose ranks never wait): per iteration how long after
    its own start each rank hands over its last bucket (the end of backward) — with starts
    (_ends), how long after its previous hand-over: DDP's ranks leave one synchronisation
    together and drift apart through the optimizer step, the next forward and backward
    until the next — those arrivals as they would come once early ranks wait and give their
    cores away (synchronised_arrivals), then compare's own statistic — per rank the mean
    over iterations of its wait for the last, the largest rank's. se: that mean's standard
    error instead."""
    its = [d for d in _ends(logs, starts).values() if len(d) == len(logs)]
    return _waits_ms([[[d[r] for r in range(len(logs))]] for d in its], cores, se)


def _waits_ms(iterations: list[list[list[float]]], cores: int, se: bool = False) -> float | None:
    """compare's statistic of the waits predicted from unsynchronised stretches: per
    iteration, per stretch every rank's duration (s), turned into arrivals with the cores
    shared (synchronised_arrivals); per rank its waits summed over an iteration's stretches,
    the mean over iterations; the largest rank's (ms). se: the standard error of that rank's
    mean instead (None below two iterations). None without an iteration."""
    if not iterations:
        return None
    ranks = max((len(offsets) for stretches in iterations for offsets in stretches), default=0)
    if not ranks:  # iterations without a stretch: nobody waits
        return None if se else 0.0
    per_rank: list[list[float]] = [[] for _ in range(ranks)]  # rank -> its wait in each iteration (s)
    for stretches in iterations:
        step = [0.0] * ranks
        for offsets in stretches:
            arrived = synchronised_arrivals(offsets, cores)
            for r, a in enumerate(arrived):
                step[r] += max(arrived) - a
        for r, w in enumerate(step):
            per_rank[r].append(w)
    worst = max(per_rank, key=sum)
    return report.standard_error([w * 1e3 for w in worst]) if se else sum(worst) / len(worst) * 1e3


def unit_waits_ms(marks: list[list], cores: int, kinds: str, se: bool = False) -> float | None:
    """The waiting a step that synchronises at every FSDP unit would show, predicted from
    the compute-only step's marks (ddp:noop: per rank (iteration, kind, block, s after its
    own start); kinds: f a unit's forward, b its backward's start, e its backward's end —
    where FSDP all-gathers and reduce-scatters). Each stretch between consecutive marks,
    every rank's duration of it turned into arrivals with the cores shared
    (synchronised_arrivals), each rank's waits summed over the step; per rank the mean
    over iterations, the largest rank's (compare's statistic). A step that synchronises at
    every unit drifts apart at every unit: one figure per step (arrival_skew_ms) is DDP's.
    se: that mean's standard error instead."""
    seq: dict[int, dict[int, list[float]]] = {}
    for rank, log in enumerate(marks):
        for i, kind, _block, t in log:
            if kind in kinds:
                seq.setdefault(i, {}).setdefault(rank, []).append(t)
    its = [[sorted(d[r]) for r in range(len(marks))] for d in seq.values()
           if len(d) == len(marks) and len({len(v) for v in d.values()}) == 1]
    return _waits_ms([[[ts[j] - ts[j - 1] for ts in times] for j in range(1, len(times[0]))] for times in its], cores,
                     se)


def mark_units(model, log: dict) -> None:
    """ddp:noop: note on log["marks"] when each FSDP unit's forward, backward and backward's
    end come (what unit_waits_ms reads), on the clock of log["start"]: the blocks', and the
    root's forward (-1: gathered before the whole forward; its reduce-scatter, after the whole
    backward, is the last bucket's hand-over: the root's own backward hook fires at backward's
    start where its input, token ids, needs no gradient)."""
    def mark(kind, k):
        def note(*_):
            if kind == "b":
                log["backward"] = True
            # A forward inside backward is checkpointing's recomputation (FSDP2 gathers once, in
            # pre-backward); before the last micro-step FSDP2 keeps its gradients unreduced.
            if (kind == "f" and log.get("backward")) or (kind == "e" and not log.get("reducing", True)):
                return
            log["marks"].append((log["iteration"], kind, k, time.perf_counter() - log["start"]))
        return note

    # The first block's input (the batch) needs no gradient, so its backward-end mark fires on
    # its outputs' gradients, as FSDP's reduce-scatter does; torch warns of that every step.
    warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed with "
                            "respect to module outputs", category=UserWarning)
    model.register_forward_pre_hook(mark("f", -1))
    for k, block in enumerate(workloads.blocks(model)):
        block.register_forward_pre_hook(mark("f", k))
        block.register_full_backward_pre_hook(mark("b", k))
        block.register_full_backward_hook(mark("e", k))


def micro_step(log: dict, last: bool) -> None:
    """A micro-step's forward begins (mark_units' log): the last one reduce-scatters."""
    log.update(backward=False, reducing=last)


def timed_on_device(mode: str, device: str, backend: str) -> bool:
    """Whether a DDP mode's sync must be read from the device (a profiled step) rather than
    from its hook's clock: `ddp` over NCCL, which marks a collective's future complete when
    it is launched (so the hook's callback runs at launch). gloo's futures complete when the
    work is done; commlab's hooks time their own calls."""
    return Mode.parse(mode).all_reduce == "builtin" and device == "cuda" and backend == "nccl"


def ddp_rank(rank: int, world: int, mode: str, args: dict) -> dict:
    """One DDP rank of a mode (run by the launcher in fresh processes); returns its measurements."""
    cuda = args["device"] == "cuda"
    backend = "nccl" if cuda and not args["share_gpu"] else "gloo"
    m = Mode.parse(mode)
    backend = m.backend or backend  # ddp@commlab: DDP's default reduction on commlab's torch.distributed backend
    device, wl, model, rss_before_model = start_rank(rank, world, args, backend)
    if args["checkpoint"]:
        # Inside the module DDP wraps: calling the inner module directly would bypass
        # DDP's forward, and with it the gradient synchronisation.
        model = workloads.Checkpointed(model)
    ddp = DDP(model, device_ids=[device.index] if cuda else None, bucket_cap_mb=args["bucket_cap_mb"])
    if m.all_reduce == "builtin":
        state = hooks.BucketStats()
        ddp.register_comm_hook(state, timed_default_hook)
    elif m.noop:
        state = None
        arrivals = {"iteration": -1, "start": 0.0, "starts": {}, "times": [], "marks": []}
        ddp.register_comm_hook(arrivals, arrival_hook)
        if not cuda:  # the marks are read on one host's clock (below)
            mark_units(wl.model, arrivals)
    else:
        state = hooks.CommState(m.algorithm)
        hooks.register(ddp, state)

    opt = optimizer(ddp.parameters(), args)
    per_rank = max(args["batch_size"] // world, 1)
    accum = args["accum_steps"]
    micro = max(per_rank // accum, 1)
    scaler = torch.amp.GradScaler(device.type) if args["amp"] == "fp16" else None
    amp_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(args["amp"])
    opt_times: list[float] = []

    def forward_loss(x, y):
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            return wl.loss(ddp(x).float(), y)

    spans: list[tuple[str, float, float]] = []  # --trace: this rank's compute, on the buckets' clock

    def step(i):
        if m.noop:  # every step's hand-overs and marks on the clock of its own start
            arrivals["iteration"] = i
            arrivals["start"] = arrivals["starts"][i] = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for k in range(accum):
            x, y = wl.make_batch(micro, seed=(i * accum + k) * 1000 + rank, device=device)
            ctx = ddp.no_sync() if k < accum - 1 else contextlib.nullcontext()
            if m.noop:
                micro_step(arrivals, last=k == accum - 1)
            with ctx:
                loss = timed_micro_batch(lambda: forward_loss(x, y) / accum, scaler, spans)
            total += float(loss.detach())
        # The optimizer's share, for this host's prediction (ddp:noop).
        opt_times.append(timed_optimizer_step(opt, scaler, cuda, spans))
        return total

    device_timed = timed_on_device(mode, device.type, backend)
    device_sync = warm_up(step, args["warmup"], device_timed)
    opt_times.clear()
    spans.clear()
    if isinstance(state, hooks.BucketStats):
        state.reset()
    elif state is not None:
        state.reset_stats()
    times, loss, util = timed_steps(step, args, device)
    optimizer_ms = sorted(opt_times)[len(opt_times) // 2] * 1e3 if opt_times else None  # the timed steps'
    slowest, mean_loss = across_ranks(times, loss, device, world)
    st = state.stats() if state is not None else {"mean_total_comm_ms": 0.0, "mean_exposed_ms": 0.0}
    timing = state if isinstance(state, hooks.BucketStats) else getattr(state, "timing", None)
    if device_timed:  # the buckets' host spans are launches: no per-bucket spans, the device's sums
        st = dict(st, mean_total_comm_ms=device_sync["total"], mean_exposed_ms=device_sync["exposed"])
        timing = None
    # Every rank's spans go back, traced or not: compare splits the exposed sync at the last arrival from them.
    traced = trace.record(spans, timing.iterations() if timing is not None else [],
                          m.all_reduce or "noop")
    per_step = st.get("per_iteration") or [{"bytes": 0}]
    tensors, params = _tensor_bytes_and_params(ddp, opt, lambda: step(args["warmup"] + args["iters"]), args)
    mem = peak_memory_mb(device, rss_before_model, args)
    if isinstance(state, hooks.CommState):
        state.close()
    skew = ends = units = wait_se = None
    if m.noop and not cuda:  # one clock: the ranks of one machine
        skew, ends, units, wait_se = arrival_figures(arrivals, world, args)
    return RankResult(slowest, mean_loss, mem, util, st["mean_total_comm_ms"], st["mean_exposed_ms"],
                      per_step[-1]["bytes"], traced, params=params, optimizer_ms=optimizer_ms,
                      arrival_skew_ms=skew, backward_end_ms=ends, unit_waits_ms=units, wait_se_ms=wait_se,
                      **tensors)


def arrival_figures(arrivals: dict, world: int, args: dict) -> tuple:
    """ddp:noop's ranks on one machine's clock: (how far apart they reach the end of
    backward, each step's backward ends, FSDP's per-unit waits, each figure's standard
    error), from every rank's hand-overs and marks of the timed steps (collective)."""
    # The timed steps (not the measuring step after them), and the last warm-up step: where
    # the first timed one's stretch since the previous end of backward begins.
    timed = range(args["warmup"], args["warmup"] + args["iters"])
    kept = range(max(0, timed.start - 1), timed.stop)
    logs, marks, starts = [None] * world, [None] * world, [None] * world
    dist.all_gather_object(logs, [t for t in arrivals["times"] if t[0] in kept])
    dist.all_gather_object(starts, {i: t for i, t in arrivals["starts"].items() if i in kept})
    root_end = [(i, "e", -1, max(ranks.values())) for i, ranks in _ends([arrivals["times"]]).items()]
    dist.all_gather_object(marks, [t for t in arrivals["marks"] + root_end if t[0] in timed])
    cores = len(os.sched_getaffinity(0))
    in_timed = [[t for t in log if t[0] in timed] for log in logs]
    # DDP's ranks drift from one end of backward to the next; ZeRO-1's from the step's
    # start (its broadcasts line them up after the optimizer).
    skew = arrival_skew_ms(logs, cores, starts=starts)
    from_start = arrival_skew_ms(in_timed, cores)
    ends = backward_ends_ms(in_timed)
    # FSDP synchronises at each block's forward, backward (resharded) and backward's end.
    units = {**{kinds: unit_waits_ms(marks, cores, kinds) for kinds in ("fbe", "fe")}, "step_start": from_start}
    # How much each figure moves from step to step: the predicted exposed sync's ± (keys as units').
    wait_se = {"step": arrival_skew_ms(logs, cores, se=True, starts=starts),
               "step_start": arrival_skew_ms(in_timed, cores, se=True),
               **{kinds: unit_waits_ms(marks, cores, kinds, se=True) for kinds in ("fbe", "fe")}}
    return skew, ends, units, wait_se


def _tensor_bytes_and_params(ddp, opt, one_step, args: dict) -> tuple[dict, list | None]:
    """One more step (after the timed ones) with the tensor bytes sampled throughout (see
    sharded.TensorBytes; DDP's buckets from its reducer), and the final parameters when
    asked for."""

    if next(ddp.parameters()).is_cuda:
        return {}, None  # on GPU the allocator's peak is the measure
    tensors = measure_step(ddp.module, opt, ddp_bucket_bytes(ddp), one_step)
    params = torch.cat([p.detach().reshape(-1).double() for p in ddp.module.parameters()]).tolist() \
        if args.get("return_params") else None
    return tensors, params


def dp_process(rank: int, world: int, args: dict) -> dict:
    """nn.DataParallel over the GPUs, in one fresh process; returns the mode's row."""
    gpus = args["gpus"] or torch.cuda.device_count()
    devices = list(range(gpus))
    if args["mem_limit_mb"]:
        for d in devices:
            metrics.cap_gpu_memory(torch.device("cuda", d), args["mem_limit_mb"])
    torch.manual_seed(0)
    wl = workloads.build(args["model"], **workloads.options(args))
    inner = workloads.Checkpointed(wl.model) if args["checkpoint"] else wl.model
    model = torch.nn.DataParallel(inner.cuda(0), device_ids=devices)
    opt = torch.optim.SGD(model.parameters(), lr=args["lr"])
    amp_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(args["amp"])
    scaler = torch.amp.GradScaler("cuda") if args["amp"] == "fp16" else None
    sampler = metrics.NvmlSampler(devices)

    def step(i):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for k in range(args["accum_steps"]):
            # The same global data as the DDP ranks see, concatenated in rank order.
            parts = [wl.make_batch(max(args["batch_size"] // gpus // args["accum_steps"], 1),
                                   seed=(i * args["accum_steps"] + k) * 1000 + r, device="cuda:0") for r in range(gpus)]
            x = torch.cat([a for a, _ in parts])
            y = torch.cat([b for _, b in parts])
            with torch.autocast("cuda", dtype=amp_dtype, enabled=amp_dtype is not None):
                loss = wl.loss(model(x).float(), y) / args["accum_steps"]
            (scaler.scale(loss) if scaler else loss).backward()
            total += float(loss.detach())
        optimizer_step(opt, scaler)
        torch.cuda.synchronize()
        return total

    for i in range(args["warmup"]):
        step(i)
    for d in devices:
        torch.cuda.reset_peak_memory_stats(d)
    sampler.start()
    times, loss = [], 0.0
    for i in range(args["warmup"], args["warmup"] + args["iters"]):
        t0 = time.perf_counter()
        loss = step(i)
        times.append(time.perf_counter() - t0)
    util = sampler.stop()
    sync_ms = metrics.profiled_comm_ms(lambda: step(args["warmup"] + args["iters"]))
    iters = report.iteration_summary(times)
    return {
        "mode": "dp", "status": "ok", "reason": "",
        "iter_ms": iters,
        "samples_per_s": args["batch_size"] / (iters["median"] / 1e3),
        "peak_memory_mb": [torch.cuda.max_memory_allocated(d) / 2**20 for d in devices],
        "util_percent": util,
        # DataParallel communicates on the compute streams: nothing hides it.
        "grad_sync_ms": {"total": sync_ms, "exposed": sync_ms, "after_arrival": sync_ms},
        "final_loss": loss,
    }
