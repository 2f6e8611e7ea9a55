"""CUDA tensors on the pure torch.distributed algorithms, found on the first GPU lent
(an H200, 2026-12-04): on a gloo group gloo's send and receive take host pointers, and a
CUDA tensor ended both ranks with "writev: Bad address" (all-gather's ring, DDP's
ddp:ring hook); and batches drawn on the CPU were most of compare's GPU step. The
decisions run anywhere; the collectives need a GPU (scripts/gpu_check.sh)."""
import pytest
import torch
import torch.distributed as dist

import commlab
from commlab.algorithms import registry
from commlab.training import workloads
from commlab.transports import p2p


@pytest.mark.parametrize("config, native", [
    ("cpu:gloo,cuda:gloo", False),   # gloo: host pointers only
    ("cpu:gloo,cuda:nccl", True),
    ("cuda:nccl", True),
    ("cpu:commlab", False),          # no CUDA backend at all
    ("cpu:commlab, cuda:nccl", True),
])
def test_which_groups_move_gpu_memory_themselves(monkeypatch, config, native):
    monkeypatch.setattr(dist, "get_backend_config", lambda group: config)
    assert p2p._moves_cuda(object()) is native


@pytest.mark.parametrize("name", ["mlp", "transformer", "tests.models:tiny_cnn", "tests.models:tokens"])
def test_batches_are_drawn_on_the_device_asked(name):
    w = workloads.build(name)
    x, y = w.make_batch(4, seed=3, device="cpu")
    assert x.device.type == "cpu" and y.device.type == "cpu"
    assert torch.equal(x, w.make_batch(4, seed=3)[0])
    if torch.cuda.is_available():
        xc, yc = w.make_batch(4, seed=3, device="cuda")
        assert xc.is_cuda and yc.is_cuda and torch.equal(xc, w.make_batch(4, seed=3, device="cuda")[0])


def _p2p_names(collective):
    return [n for n in registry(collective).for_device("cuda") if n not in ("ipc", "auto")]


def cuda_collectives(rank, p):
    """Every CUDA-claiming algorithm of each family on a gloo group, checked exactly."""
    torch.cuda.set_device(0)  # ranks share the one GPU
    wrong = []
    for name in _p2p_names("all_reduce"):
        for n in (1, 1000, 70_001):
            x = (torch.arange(n, device="cuda") % 7 + rank).float()
            commlab.all_reduce(x, algorithm=name)
            want = (p * (torch.arange(n, device="cuda") % 7) + sum(range(p))).float()
            if not torch.equal(x, want):
                wrong.append(f"all_reduce {name} n={n}")
    for name in _p2p_names("all_gather"):
        for n in (1, 333, 40_000):
            inp = torch.full((n,), rank + 1, dtype=torch.int32, device="cuda")
            out = torch.empty(p * n, dtype=torch.int32, device="cuda")
            commlab.all_gather(out, inp, algorithm=name)
            want = torch.arange(1, p + 1, dtype=torch.int32, device="cuda").repeat_interleave(n)
            if not torch.equal(out, want):
                wrong.append(f"all_gather {name} n={n}")
    return wrong


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 3])
def test_every_cuda_algorithm_on_a_gloo_group(ranks, world):
    for wrong in ranks.run(world, cuda_collectives):
        assert wrong == [], wrong


def test_the_gpu_check_asks_compare_only_for_modes_it_runs_on_cuda():
    """scripts/gpu_check.sh is run once, on a lent GPU, unattended: a step naming a mode
    compare does not offer on cuda comes back as an "unavailable" row in a run that
    exits 0, and the check reports as done what never ran. Its sharded step asked for
    zero1 and fsdp on cuda, which compare runs on CPU only."""
    import os
    import re
    import shlex

    from commlab.training.compare import cli

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "scripts", "gpu_check.sh")) as f:
        script = f.read().replace("\\\n", " ")
    cuda = set(cli.all_modes("cuda"))
    asked = []
    for line in script.splitlines():
        if "commlab.compare" in line and "--device cuda" in line:
            words = shlex.split(line.split("commlab.compare", 1)[1])
            asked += words[words.index("--modes") + 1].split(",")
    assert asked and not [m for m in asked if m not in cuda], (asked, sorted(cuda))
    for part in re.findall(r"want (\w+) &&", script):  # every part a step runs is in the parts list
        assert f" {part} " in " " + script.split('PARTS=" ${*:-', 1)[1].split("}", 1)[0] + " ", part
