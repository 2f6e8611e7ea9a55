"""The sharded compare modes, one rank each (run by the launcher in fresh processes):

- `zero1`: DDP's default reduction (timed as in `ddp`) with torch's
  ZeroRedundancyOptimizer: each rank keeps the optimizer state of 1/p of the
  parameters and broadcasts its updated shard after every step;
- `fsdp`: FSDP2's `fully_shard` on every block and the root, torch's own collectives
  (timed); `fsdp:noreshard` the same with reshard_after_forward=False (ZeRO-2-like:
  parameters stay gathered from forward to backward); `fsdp:<algorithm>` FSDP's
  all-gathers and reduce-scatters through commlab's families (commlab.training.fsdp).

Each takes compare's --accum-steps, --amp (fp16 through a loss scaler: FSDP's sharded
one, which agrees on an overflow across the shards) and --checkpoint (activations
recomputed in backward as in the DDP modes: workloads.Checkpointed).

Beside the process's peak RSS (on CPU the interpreter's ~700 MB hides what sharding
saves), each rank reports the peak of the tensor bytes it holds — parameters (its own,
or its shards), FSDP's gathered parameters while a unit is unsharded, gradients,
optimizer state and DDP's buckets —
counted from the live tensors (unique storages) at every leaf module's forward, every
gradient's accumulation and after the optimizer step, in one extra step after the
timed ones."""
from __future__ import annotations

import contextlib
import time
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel as DDP

from commlab.experiments import workloads
from commlab.experiments.compare import steps
from commlab.experiments.modes import Mode
from commlab.measure import trace
from commlab.training import fsdp, hooks


def optimizer(params, args: dict) -> torch.optim.Optimizer:
    if args.get("optimizer", "sgd") == "adamw":
        return torch.optim.AdamW(params, lr=args["lr"])
    return torch.optim.SGD(params, lr=args["lr"])


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _groups(model: torch.nn.Module):
    for m in model.modules():
        get_state = getattr(m, "_get_fsdp_state", None)
        group = getattr(get_state(), "_fsdp_param_group", None) if get_state else None
        if group is not None:
            yield group


def _gathered(model: torch.nn.Module):
    """FSDP2's unsharded parameters (its FSDPParam._unsharded_param; their storage is
    freed, size 0, while the unit is resharded): private, so looked up with care."""
    for group in _groups(model):
        for fp in getattr(group, "fsdp_params", None) or []:
            t = getattr(fp, "_unsharded_param", None)
            if isinstance(t, torch.Tensor):
                yield t


def _in_flight(model: torch.nn.Module):
    """FSDP2's all-gather output buffers not yet copied out: a unit prefetched for
    backward holds its gathered bytes here before its parameters exist."""
    for group in _groups(model):
        result = getattr(group, "_all_gather_result", None)
        t = getattr(result, "all_gather_output", None)
        if isinstance(t, torch.Tensor):
            yield t


class TensorBytes:
    """The peak, over the samples taken, of the bytes of unique storages this rank holds
    in each category (a storage counted once, in the first category that holds it)."""

    CATEGORIES = ("parameters", "gathered", "gradients", "optimizer_state", "buckets")

    def __init__(self, model: torch.nn.Module, opt, buckets: int = 0):
        self.model, self.opt, self.buckets = model, opt, buckets
        self.peak_total, self.at_peak = 0, {}

    def _optimizer_state(self):
        inner = getattr(self.opt, "optim", self.opt)  # ZeroRedundancyOptimizer keeps its shard's optimizer in .optim
        for state in inner.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    yield _local(v)

    def sample(self, *_args) -> None:
        seen: set[int] = set()
        got = dict.fromkeys(self.CATEGORIES, 0)

        def count(category: str, t) -> None:
            if t is None:
                return
            t = _local(t)
            s = t.untyped_storage()
            if s.data_ptr() in seen or s.nbytes() == 0:
                return
            seen.add(s.data_ptr())
            got[category] += s.nbytes()

        # Registered now (FSDP's sharded DTensors, or the gathered tensors while a unit
        # computes) and what the optimizer steps (the shards, registered or not).
        params = list(self.model.parameters()) + [p for g in self.opt.param_groups for p in g["params"]]
        gathered = list(_gathered(self.model))
        for t in gathered + list(_in_flight(self.model)):  # first: while a unit is unsharded FSDP registers
            count("gathered", t)  # these as its parameters
        for p in params:
            count("parameters", p)
        for p in params + gathered:
            count("gradients", p.grad)
        for t in self._optimizer_state():
            count("optimizer_state", t)
        got["buckets"] = self.buckets
        total = sum(got.values())
        if total > self.peak_total:
            self.peak_total, self.at_peak = total, got

    def attach(self) -> list:
        """Samples at every leaf module's forward and every gradient's accumulation —
        into FSDP's unsharded parameters too (the registered shards get theirs only after
        the reduce-scatter, when the unit's full gradients are gone)."""
        handles = [m.register_forward_hook(self.sample) for m in self.model.modules()
                   if not list(m.children()) and list(m.parameters(recurse=False))]
        handles += [p.register_post_accumulate_grad_hook(self.sample)
                    for p in [*self.model.parameters(), *_gathered(self.model)] if p.requires_grad]
        return handles


def ddp_bucket_bytes(ddp: DDP) -> int:
    """The bytes of DDP's gradient buckets, from its reducer."""
    return sum(b.buffer().numel() * b.buffer().element_size() for b in ddp.reducer._get_zeros_like_grad_buckets())


def measure_step(model: torch.nn.Module, opt, buckets: int, one_step) -> dict:
    """One more step (after the timed ones) with the tensor bytes sampled throughout:
    compare's tensor_mb and its breakdown."""
    counter = TensorBytes(model, opt, buckets)
    handles = counter.attach()
    counter.sample()
    one_step()
    counter.sample()
    for h in handles:
        h.remove()
    return {"tensor_mb": counter.peak_total / 2**20,
            "tensor_breakdown_mb": {k: v / 2**20 for k, v in counter.at_peak.items()}}


def sharded_rank(rank: int, world: int, mode: str, args: dict) -> dict:
    """One rank of a sharded mode; returns its measurements (as workers.ddp_rank does).
    On a GPU (NCCL, one GPU per rank) the collectives run on FSDP's and NCCL's streams:
    their bytes are counted per call and their time read from the device in a profiled
    step, the last warm-up step (metrics.profiled_sync_ms)."""
    cuda = args["device"] == "cuda"
    device, wl, model, rss_before_model = steps.start_rank(rank, world, args)
    comm = fsdp.CommStats()
    buckets_state = None
    zero_sync = {"s": 0.0, "bytes": 0, "steps": 0, "calls": []}
    if mode == "zero1":
        # ~0.5 s: only ZeRO-1 loads it
        from torch.distributed.optim import ZeroRedundancyOptimizer

        # Checkpointing inside what DDP wraps, as ddp_rank does (DDP's forward must run).
        net = DDP(workloads.Checkpointed(model) if args["checkpoint"] else model, bucket_cap_mb=args["bucket_cap_mb"],
                  device_ids=[device.index] if cuda else None)
        buckets_state = hooks.BucketStats()
        net.register_comm_hook(buckets_state, steps.timed_default_hook)
        kind = torch.optim.AdamW if args.get("optimizer", "sgd") == "adamw" else torch.optim.SGD
        opt = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=kind, lr=args["lr"])
        sync = opt._sync_params  # every rank's updated shard to every rank: ZeRO-1's own communication

        def timed_sync():
            t0 = time.perf_counter()
            sync()
            t1 = time.perf_counter()
            nbytes = sum(p.numel() * p.element_size() for p in net.parameters())
            zero_sync["s"] += t1 - t0
            zero_sync["bytes"] += nbytes
            zero_sync["steps"] += 1
            zero_sync["calls"].append({"kind": "broadcast", "start": t0, "end": t1, "bytes": nbytes})
        opt._sync_params = timed_sync
    else:
        # ~0.5 s: only the FSDP modes load it
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh.from_group(dist.group.WORLD, device.type)
        m = Mode.parse(mode)
        reshard = m.reshard
        for block in workloads.blocks(model):
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        algorithm = m.algorithm
        fsdp.use(model, algorithm, comm)
        # Recomputed in backward as --checkpoint does in every mode; a block's recomputation
        # runs after its pre-backward unshard, so FSDP2 gathers nothing more for it.
        net = workloads.Checkpointed(model) if args["checkpoint"] else model
        opt = optimizer(model.parameters(), args)
    per_rank = max(args["batch_size"] // world, 1)

    spans: list[tuple[str, float, float]] = []  # --trace: this rank's compute, on the collectives' clock

    accum = args.get("accum_steps", 1)
    micro = max(per_rank // accum, 1)
    amp_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(args.get("amp"))
    scaler = None
    if args.get("amp") == "fp16":
        # fp16 needs loss scaling; FSDP's gradients are shards, so a rank alone cannot tell
        # whether any gradient overflowed: the sharded scaler all-reduces that verdict
        # (imported here: ~0.5 s, only the FSDP modes load it).
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        scaler = torch.amp.GradScaler(device.type) if mode == "zero1" else ShardedGradScaler(device.type)
        # Its one-element found_inf meets DTensor gradients and is replicated, as it should be: said once per call.
        warnings.filterwarnings("ignore", message="Found a non-scalar tensor with numel=1", category=UserWarning)

    def reducing(on: bool):
        """Gradient accumulation: no communication before the last micro-step (DDP's
        no_sync for zero1; FSDP2 keeps the unsharded gradients until then)."""
        if mode == "zero1":
            return contextlib.nullcontext() if on else net.no_sync()
        model.set_requires_gradient_sync(on)
        return contextlib.nullcontext()

    def step(i):
        comm.step()
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for k in range(accum):
            x, y = wl.make_batch(micro, seed=(i * accum + k) * 1000 + rank, device=device)
            with reducing(k == accum - 1):
                def loss_of():
                    with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                        return wl.loss(net(x).float(), y) / accum

                loss = steps.timed_micro_batch(loss_of, scaler, spans)
            total += float(loss.detach())
        steps.timed_optimizer_step(opt, scaler, cuda, spans)
        return total

    device_sync = steps.warm_up(step, args["warmup"], cuda)
    comm.reset()
    spans.clear()
    if buckets_state is not None:
        buckets_state.reset()
    zero_sync.update(s=0.0, bytes=0, steps=0, calls=[])
    times, loss, util = steps.timed_steps(step, args, device)
    # The timed steps' communication, before the measuring step adds its own.
    if mode == "zero1":
        st = buckets_state.stats()
        n = max(zero_sync["steps"], 1)
        total = st["mean_total_comm_ms"] + zero_sync["s"] * 1e3 / n
        exposed = st["mean_exposed_ms"] + zero_sync["s"] * 1e3 / n  # the broadcasts block the step
        per_step = (st["per_iteration"][-1]["bytes"] if st["per_iteration"] else 0) + zero_sync["bytes"] / n
        iterations = [dict(it, calls=[c]) for it, c in zip(buckets_state.iterations(), zero_sync["calls"])]
    else:
        st = comm.summary()
        total, exposed, per_step = st["mean_total_comm_ms"], st["mean_exposed_ms"], st["mean_bytes"]
        iterations = comm.iterations()
    if cuda:  # the host saw launches: the device's own times, from the profiled step, and no per-call spans
        total, exposed = device_sync["total"], device_sync["exposed"]
        iterations = []
    traced = trace.record(spans, iterations, Mode.parse(mode).collectives)  # as ddp_rank's: the exposed sync's split
    tensors = measure_step(model, opt, ddp_bucket_bytes(net) if mode == "zero1" else 0,
                           lambda: step(args["warmup"] + args["iters"]))
    slowest, mean_loss = steps.across_ranks(times, loss, device, world)
    params = None
    if args.get("return_params"):
        full = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in model.parameters()]
        params = torch.cat([t.reshape(-1).double() for t in full]).tolist()
    memory_mb = steps.peak_memory_mb(device, rss_before_model, args)
    return steps.RankResult(slowest, mean_loss, memory_mb, util, total, exposed, per_step, traced, params=params,
                            **tensors)
