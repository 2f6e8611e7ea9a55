"""One training step of a workload, traced on meta tensors (no weights, no data, no
device): every operation's FLOPs (torch.utils.flop_counter's formulas) and bytes moved,
when each parameter's gradient is ready during backward, and the memory facts."""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from commlab.experiments import workloads


@dataclass(frozen=True)
class Op:
    phase: str  # fwd | bwd | opt
    flops: float
    bytes: float  # tensor bytes read and written
    kind: str  # conv | mm (matrix products) | "" (element-wise and the rest)


@dataclass(frozen=True)
class Unit:
    """What FSDP shards as one (fully_shard per block, workloads.blocks; the root unit
    holds the rest): its parameters and the operations of its forward."""

    params: tuple[int, ...]  # indices into Step.params
    fwd: tuple[int, int]  # ops [start, end) of its forward (the root's: the whole forward)


@dataclass
class Step:
    """One step at `batch` samples on one device."""

    batch: int
    ops: list[Op]
    params: list[int]  # bytes of each parameter, in model.parameters() order
    grad_ready: dict[int, int]  # parameter index -> number of ops done when its gradient is accumulated
    activation_bytes: float  # saved for backward (distinct storages, parameters excluded)
    peak_bytes: float  # the most bytes alive at once in the step, parameters excluded (activations, gradients,
    # temporaries, recomputed segments under checkpointing): what an allocator must hold beyond the weights
    input_bytes: float
    output_bytes: float
    buffers_bytes: float = 0.0
    notes: list[str] = field(default_factory=list)
    units: list[Unit] = field(default_factory=list)  # blocks in forward order, then the root
    live: list[float] = field(default_factory=list)  # bytes alive after each dispatched op (peak_bytes is its max)
    optimizer: str = "sgd"

    @property
    def param_bytes(self) -> int:
        return sum(self.params)

    def flops(self, phase: str) -> float:
        return sum(o.flops for o in self.ops if o.phase == phase)


class _Recorder(TorchDispatchMode):
    def __init__(self, skip: set):
        super().__init__()
        self.ops: list[Op] = []
        self.phase = "fwd"
        self.skip = skip  # the parameters' storages: the weights are counted apart
        self.live: dict = {}  # storage -> bytes, for every tensor an op made that is still alive
        self.alive = 0  # their sum
        self.peak = 0.0
        self.curve: list[float] = []  # bytes alive after every dispatched op: the peak at any batch

    def _died(self, k) -> None:
        self.alive -= self.live.pop(k)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                k = StorageWeakRef(storage)
                if k not in self.skip and k not in self.live:
                    self.live[k] = storage.nbytes()
                    self.alive += self.live[k]
                    # A storage keeps its Python object while it lives: told of its death, where a
                    # scan of every live storage after every op grew with the model squared.
                    weakref.finalize(storage, self._died, k).atexit = False
        self.curve.append(float(self.alive))
        self.peak = max(self.peak, self.curve[-1])
        packet = func._overloadpacket
        if func.is_view or packet in _FREE:
            return out
        flops = flop_registry[packet](*args, **kwargs, out_val=out) if packet in flop_registry else 0
        moved = sum(t.numel() * t.element_size() for t in tree_flatten((args, kwargs, out))[0]
                    if isinstance(t, torch.Tensor))
        kind = "conv" if "convolution" in str(packet) else ("mm" if packet in _MM else "")
        self.ops.append(Op(self.phase, float(flops), float(moved), kind))
        return out


_aten = torch.ops.aten
# Allocations and aliases move no bytes; copies and casts (clone, _to_copy) do, and are priced.
_FREE = {_aten.detach, _aten.empty, _aten.empty_like, _aten.zeros_like, _aten.lift_fresh}
_MM = {_aten.mm, _aten.addmm, _aten.bmm, _aten.baddbmm, _aten.matmul}


OPTIMIZERS = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1), "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.1)}


def trace(model_name: str, batch: int, *, width: int = 1024, depth: int = 4, checkpoint: bool = False,
          input_shape: tuple[int, ...] | None = None, optimizer: str = "sgd") -> Step:
    """One step (forward, loss, backward, optimizer step as compare's) at `batch`
    samples, in fp32 on meta (autocast does not reach meta tensors: the model applies
    AMP)."""
    with torch.device("meta"):
        w = workloads.build(model_name, width=width, depth=depth, input_shape=input_shape)
        model = w.model
        blocks = workloads.blocks(model)
        if checkpoint:
            model = workloads.Checkpointed(model)
    x, y = w.make_batch(batch, 0)
    x, y = x.to("meta"), y.to("meta")
    params = list(model.parameters())
    index = {id(p): i for i, p in enumerate(params)}
    keys = {StorageWeakRef(t.untyped_storage()) for t in [*params, *model.buffers()]}
    saved: dict = {}

    def pack(t):
        k = StorageWeakRef(t.untyped_storage())
        if k not in keys:
            saved[k] = t.untyped_storage().nbytes()
        return t

    rec = _Recorder(keys)
    ready: dict[int, int] = {}

    def accumulated(p):
        ready.setdefault(index[id(p)], len(rec.ops))

    spans: dict[int, list[int]] = {}  # block -> [first op, end op] of its first forward (not a recomputation)

    def entered(m, *_):
        spans.setdefault(id(m), [len(rec.ops), len(rec.ops)])

    def left(m, *_):
        if len(spans[id(m)]) == 2 and rec.phase == "fwd":
            spans[id(m)][1] = len(rec.ops)
            spans[id(m)].append(True)

    hooks = [p.register_post_accumulate_grad_hook(accumulated) for p in params]
    hooks += [b.register_forward_pre_hook(entered) for b in blocks] + [b.register_forward_hook(left) for b in blocks]
    opt = OPTIMIZERS[optimizer](params)
    # The optimizer's state lives through every step, not only its end: made before the
    # traced step and kept out of its peak (the prediction adds it whole).
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    keys |= {StorageWeakRef(v.untyped_storage()) for st in opt.state.values() for v in st.values()
             if isinstance(v, torch.Tensor)}
    try:
        with rec, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(x)
            loss = w.loss(out, y)
            fwd_end = len(rec.ops)
            rec.phase = "bwd"
            loss.backward()
        rec.phase = "opt"
        with rec:
            opt.step()
    finally:
        for h in hooks:
            h.remove()
    units, owned = [], set()
    for b in blocks:
        mine = tuple(index[id(p)] for p in b.parameters() if id(p) in index and index[id(p)] not in owned)
        if mine and id(b) in spans:
            owned.update(mine)
            units.append(Unit(mine, (spans[id(b)][0], spans[id(b)][1])))
    units.append(Unit(tuple(i for i in range(len(params)) if i not in owned), (0, fwd_end)))
    return Step(batch=batch, ops=rec.ops, params=[p.numel() * p.element_size() for p in params], grad_ready=ready,
                activation_bytes=float(sum(saved.values())), peak_bytes=rec.peak, input_bytes=float(x.numel() * x.element_size()),
                output_bytes=float(out.numel() * out.element_size()),
                buffers_bytes=float(sum(b.numel() * b.element_size() for b in model.buffers())),
                units=units, optimizer=optimizer, live=rec.curve)
