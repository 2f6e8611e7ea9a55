"""Training workloads: synthetic ones with a tunable parameter count, so the ratio of
communication to computation can be dialled (no downloads, no torchvision needed), any
torchvision classifier, and the user's own model from a factory (`package.module:factory`)."""
from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential


def mlp(width: int = 1024, depth: int = 4, in_features: int = 256, out_features: int = 16) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(in_features, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, out_features))
    return nn.Sequential(*layers)


def generator(seed: int, device="cpu") -> torch.Generator:
    """A seeded generator on `device`: batches are drawn where they are used (drawn on the
    CPU, a GPU's batch took longer than its whole step: docs/measurements.md#figures-behind-the-codes-choices)."""
    g = torch.Generator(device=torch.device(device))
    g.manual_seed(seed)
    return g


def batch(model: nn.Module, batch_size: int, seed: int, device="cpu"):
    first = next(m for m in model.modules() if isinstance(m, nn.Linear))
    last = [m for m in model.modules() if isinstance(m, nn.Linear)][-1]
    g = generator(seed, device)
    x = torch.randn(batch_size, first.in_features, generator=g, device=device)
    y = torch.randn(batch_size, last.out_features, generator=g, device=device)
    return x, y


def param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


class TransformerStack(nn.Module):
    """A small transformer encoder on random token embeddings."""

    def __init__(self, d_model: int = 256, layers: int = 2, heads: int = 4, seq: int = 64, out_features: int = 16):
        super().__init__()
        self.seq = seq
        self.d_model = d_model
        self.blocks = nn.Sequential(*[
            nn.TransformerEncoderLayer(d_model, heads, dim_feedforward=4 * d_model, batch_first=True, dropout=0.0)
            for _ in range(layers)])
        self.head = nn.Linear(d_model, out_features)

    def forward(self, x):
        return self.head(self.blocks(x).mean(dim=1))


def blocks(model: nn.Module) -> list[nn.Module]:
    """The units FSDP shards one by one (fully_shard per block): a transformer's blocks, a
    Sequential's layers with parameters, else the model's children with parameters."""
    if isinstance(model, TransformerStack):
        return list(model.blocks)
    return [m for m in model.children() if any(True for _ in m.parameters())]


class Recomputed(nn.Module):
    """One block whose activations backward recomputes: Checkpointed puts it in the block's place."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *args, **kwargs):

        return checkpoint(self.block, *args, use_reentrant=False, **kwargs)


class Checkpointed(nn.Module):
    """Gradient checkpointing around a model: activations are recomputed in backward
    (the seed's memory tip), block by block as training code does, so backward holds one
    block's activations at a time: each of the model's units with a structure of its own
    (blocks(); a Sequential unit's own blocks: a transformer's layers, a ResNet's
    bottlenecks) is replaced in place by a Recomputed block. A Sequential of plain layers
    (the MLP) is cut into two segments; anything else is checkpointed whole, which
    recomputes every activation at once in backward and lowers no peak."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        targets = []
        for unit in blocks(inner):
            for b in (unit.children() if isinstance(unit, nn.Sequential) else [unit]):
                if any(True for _ in b.children()):  # a layer alone saves what its checkpoint would
                    targets.append(b)
        chosen = {id(b) for b in targets}
        for parent in list(inner.modules()):
            for name, child in list(parent.named_children()):
                if id(child) in chosen:
                    setattr(parent, name, Recomputed(child))
        self.blockwise = bool(targets)

    def forward(self, x):

        if self.blockwise:
            return self.inner(x)
        if isinstance(self.inner, nn.Sequential) and len(self.inner) >= 2:
            return checkpoint_sequential(self.inner, 2, x, use_reentrant=False)
        return checkpoint(self.inner, x, use_reentrant=False)


@dataclass
class Workload:
    name: str
    model: nn.Module
    make_batch: Callable[..., tuple]  # (batch_size, seed, device="cpu") -> (x, y) drawn on that device
    loss: Callable


def options(args: dict) -> dict:
    """build()'s keyword arguments from a CLI's parsed arguments."""
    return {"width": args["width"], "depth": args["depth"], "input_shape": args.get("input_shape")}


def parse_shape(text: str | None) -> tuple[int, ...] | None:
    """--input-shape "3,224,224" -> (3, 224, 224): one sample's shape, without the batch."""
    if not text:
        return None
    try:
        shape = tuple(int(d) for d in text.replace("x", ",").split(",") if d.strip())
    except ValueError:
        raise ValueError(f"--input-shape takes one sample's dimensions, e.g. 3,224,224 (got {text!r})") from None
    if not shape or min(shape) <= 0:
        raise ValueError(f"--input-shape needs positive dimensions (got {text!r})")
    return shape


def load_factory(spec: str) -> Callable:
    """`package.module:factory` (the factory may be a dotted attribute path) -> the callable.
    The working directory is searched too, as `python -m` does for the main process."""
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ValueError(f"--model {spec!r}: a factory is named package.module:function")
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if os.getcwd() in sys.path or not (e.name or "").startswith(module.split(".")[0]):
            raise ValueError(f"--model {spec!r}: cannot import {module!r} ({e})") from None
        sys.path.insert(0, os.getcwd())
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e2:
            raise ValueError(f"--model {spec!r}: cannot import {module!r} ({e2})") from None
    obj = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"--model {spec!r}: {module} has no {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"--model {spec!r}: {attr} is not callable")
    return obj


def _made(spec: str, made) -> tuple[nn.Module, torch.Tensor | None]:
    if isinstance(made, nn.Module):
        return made, None
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module) and isinstance(made[1], torch.Tensor):
        return made
    raise ValueError(f"--model {spec!r}: the factory must return an nn.Module, or (module, example input batch); "
                     f"it returned {type(made).__name__}")


def user_model(spec: str, input_shape: tuple[int, ...] | None = None) -> Workload:
    """The user's model: the factory's module, inputs of --input-shape (float32) or of the
    example batch the factory returned (its dtype; integers drawn below its maximum + 1, as
    token ids), targets of the output's shape and an MSE loss: a training step of the
    model's own size and shape, on synthetic data."""
    factory = load_factory(spec)
    model, example = _made(spec, factory())
    if input_shape is not None:
        shape, dtype, high = tuple(input_shape), torch.float32, None
    elif example is not None and example.dim() >= 1:
        shape, dtype = tuple(example.shape[1:]), example.dtype
        # Ids on meta (predict's trace) have no values, and need none.
        high = None if dtype.is_floating_point else (1 if example.is_meta else int(example.max()) + 1)
    else:
        raise ValueError(f"--model {spec!r}: give one sample's shape with --input-shape (e.g. 3,224,224), or have "
                         "the factory return (module, example input batch)")

    def inputs(bs, g, device="cpu"):
        if high is None:
            return torch.randn(bs, *shape, generator=g, dtype=dtype if dtype.is_floating_point else torch.float32,
                               device=device)
        return torch.randint(0, high, (bs, *shape), generator=g, dtype=dtype, device=device)

    # The output's shape from a forward on meta tensors: no memory, no compute.
    with torch.device("meta"):
        probe, _ = _made(spec, factory())
        try:
            out = probe(inputs(2, None).to("meta"))
        except Exception as e:  # noqa: BLE001 - the user's model: say what failed
            raise ValueError(f"--model {spec!r}: a forward pass on a batch of shape {(2, *shape)} failed: "
                             f"{type(e).__name__}: {e}") from None
    if not isinstance(out, torch.Tensor) or not out.dtype.is_floating_point:
        raise ValueError(f"--model {spec!r}: the model must return one floating-point tensor (got {type(out).__name__})")
    out_shape = tuple(out.shape[1:])

    def make_batch(bs, seed, device="cpu"):
        g = generator(seed, device)
        return inputs(bs, g, device), torch.randn(bs, *out_shape, generator=g, device=device)

    return Workload(spec, model, make_batch, nn.functional.mse_loss)


def build(name: str, *, width: int = 1024, depth: int = 4, input_shape: tuple[int, ...] | None = None) -> Workload:
    """Models by name: 'mlp' and 'transformer' built in (width/depth dial the parameter
    count); any torchvision classification model ('resnet50', ...) when installed; the
    user's own as 'package.module:factory' (user_model)."""
    if ":" in name:
        return user_model(name, input_shape)
    if name == "mlp":
        model = mlp(width=width, depth=depth)

        def make_batch(bs, seed, device="cpu"):
            return batch(model, bs, seed, device)

        return Workload(name, model, make_batch, nn.functional.mse_loss)
    if name == "transformer":
        model = TransformerStack(d_model=width, layers=depth)

        def make_batch(bs, seed, device="cpu"):
            g = generator(seed, device)
            return (torch.randn(bs, model.seq, model.d_model, generator=g, device=device),
                    torch.randn(bs, model.head.out_features, generator=g, device=device))

        return Workload(name, model, make_batch, nn.functional.mse_loss)
    try:
        # optional: only the torchvision models need it
        import torchvision
    except ImportError:
        raise ValueError(f"unknown model {name!r}: built in are mlp and transformer, a factory is "
                         "package.module:function; install torchvision for its models") from None
    try:
        model = torchvision.models.get_model(name, weights=None)
    except (ValueError, KeyError) as e:
        raise ValueError(f"unknown model {name!r} ({e})") from None

    def make_batch(bs, seed, device="cpu"):
        g = generator(seed, device)
        return (torch.randn(bs, 3, 224, 224, generator=g, device=device),
                torch.randint(0, 1000, (bs,), generator=g, device=device))

    return Workload(name, model, make_batch, nn.functional.cross_entropy)
