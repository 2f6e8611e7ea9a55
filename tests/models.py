"""Models defined in a test file, as a user's own would be: `--model tests.models:tiny_cnn`."""
import torch
import torch.nn as nn


def tiny_cnn():
    """A small CNN that brings its own example input batch (per-sample shape 3x16x16)."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(),
                          nn.Linear(8 * 4 * 4, 10))
    return model, torch.randn(2, 3, 16, 16)


def tiny_mlp():
    """A module alone: the sample shape comes from --input-shape (32)."""
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))


class Tokens(nn.Module):
    """Integer token ids in, as a language model takes them."""

    def __init__(self, vocab=100, dim=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.out = nn.Linear(dim, 3)

    def forward(self, ids):
        return self.out(self.emb(ids).mean(dim=1))


def tokens():
    return Tokens(), torch.randint(0, 100, (2, 12))


def not_a_model():
    return 42
