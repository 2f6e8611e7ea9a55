"""Synthetic training workloads with a tunable parameter count, so the ratio of
communication to computation can be dialled (no downloads, no torchvision needed)."""
from __future__ import annotations

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
