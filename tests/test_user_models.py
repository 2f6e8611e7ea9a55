"""The user's own model, `--model package.module:factory`, in compare and predict: a
model defined in a test file (tests/models.py) is trained by DDP on every rank, traced
by predict, and a factory that cannot serve is a clear error before any rank starts (the
CLIs' runs with it: tests/test_compare_runs.py)."""
import os

import pytest
import torch

from commlab.experiments import workloads
from commlab.experiments.predict.graph import trace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_factory_with_its_example_input():
    w = workloads.build("tests.models:tiny_cnn")
    x, y = w.make_batch(5, seed=1)
    assert x.shape == (5, 3, 16, 16) and y.shape == (5, 10)
    assert torch.equal(x, w.make_batch(5, seed=1)[0])  # the same data for the same seed, on every rank
    w.loss(w.model(x), y).backward()
    assert all(p.grad is not None for p in w.model.parameters())


def test_input_shape_and_integer_inputs():
    w = workloads.build("tests.models:tiny_mlp", input_shape=workloads.parse_shape("32"))
    x, y = w.make_batch(3, seed=0)
    assert x.shape == (3, 32) and y.shape == (3, 4)
    ids, _ = workloads.build("tests.models:tokens").make_batch(4, seed=0)
    assert ids.dtype == torch.int64 and ids.shape == (4, 12) and 0 <= int(ids.min()) and int(ids.max()) < 100
    assert workloads.parse_shape("3x224x224") == (3, 224, 224)


@pytest.mark.parametrize("spec, shape, says", [
    ("tests.models:tiny_mlp", None, "--input-shape"),
    ("tests.models:not_a_model", None, "must return an nn.Module"),
    ("tests.models:nothing_here", None, "has no 'nothing_here'"),
    ("no_such_package.mod:f", None, "cannot import"),
    ("tests.models:tiny_mlp", (7,), "forward pass"),
    ("tests.models", None, "unknown model"),
])
def test_a_factory_that_cannot_serve_is_a_clear_error(spec, shape, says):
    with pytest.raises(ValueError, match=says):
        workloads.build(spec, input_shape=shape)


def test_predict_traces_the_users_model():
    step = trace("tests.models:tiny_cnn", 4)
    n = sum(p.numel() for p in workloads.build("tests.models:tiny_cnn").model.parameters())
    assert sum(step.params) == 4 * n  # every parameter, fp32
    assert len(step.grad_ready) == len(step.params) and step.input_bytes == 4 * 3 * 16 * 16 * 4
    conv = [o for o in step.ops if o.kind == "conv"]
    assert conv and conv[0].flops > 0
