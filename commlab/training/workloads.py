"""Synthetic training workloads with a tunable parameter count, so the ratio of
communication to computation can be dialled (no downloads, no torchvision needed)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn


def mlp(width: int = 1024, depth: int = 4, in_features: int = 256, out_features: int = 16) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(in_features, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, out_features))
    return nn.Sequential(*layers)


def batch(model: nn.Module, batch_size: int, seed: int, device="cpu"):
    first = next(m for m in model.modules() if isinstance(m, nn.Linear))
    last = [m for m in model.modules() if isinstance(m, nn.Linear)][-1]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, first.in_features, generator=g)
    y = torch.randn(batch_size, last.out_features, generator=g)
    return x.to(device), y.to(device)


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


class Checkpointed(nn.Module):
    """Gradient checkpointing around a model: activations are recomputed in backward
    (the seed's memory tip). Sequential models are cut into two segments; others are
    checkpointed whole."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint, checkpoint_sequential

        if isinstance(self.inner, nn.Sequential) and len(self.inner) >= 2:
            return checkpoint_sequential(self.inner, 2, x, use_reentrant=False)
        return checkpoint(self.inner, x, use_reentrant=False)


@dataclass
class Workload:
    name: str
    model: nn.Module
    make_batch: Callable[[int, int], tuple]  # (batch_size, seed) -> (x, y) on CPU
    loss: Callable


def build(name: str, *, width: int = 1024, depth: int = 4) -> Workload:
    """Models by name: 'mlp' and 'transformer' built in (width/depth dial the parameter
    count); any torchvision classification model ('resnet50', ...) when installed."""
    if name == "mlp":
        model = mlp(width=width, depth=depth)

        def make_batch(bs, seed):
            return batch(model, bs, seed)

        return Workload(name, model, make_batch, nn.functional.mse_loss)
    if name == "transformer":
        model = TransformerStack(d_model=width, layers=depth)

        def make_batch(bs, seed):
            g = torch.Generator().manual_seed(seed)
            return (torch.randn(bs, model.seq, model.d_model, generator=g),
                    torch.randn(bs, model.head.out_features, generator=g))

        return Workload(name, model, make_batch, nn.functional.mse_loss)
    try:
        import torchvision
    except ImportError:
        raise ValueError(f"unknown model {name!r}: built in are mlp and transformer; install torchvision for others") from None
    try:
        model = torchvision.models.get_model(name, weights=None)
    except (ValueError, KeyError) as e:
        raise ValueError(f"unknown model {name!r} ({e})") from None

    def make_batch(bs, seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(bs, 3, 224, 224, generator=g), torch.randint(0, 1000, (bs,), generator=g)

    return Workload(name, model, make_batch, nn.functional.cross_entropy)
