"""DDP hooks on CUDA (run by scripts/gpu_check.sh; skipped without a GPU): the bucket is
reduced on the state's stream after the stream that produced it, and the hook's
CUDA-aware Future orders DDP's use of the result after that work."""
import copy

import pytest
import torch
import torch.nn as nn
from cases import digest
from torch.nn.parallel import DistributedDataParallel as DDP

import commlab.hooks as hooks

pytestmark = pytest.mark.gpu


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(256, 512), nn.Linear(512, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def cuda_parity(rank, p, algorithm):
    torch.cuda.set_device(0)  # processes share the one GPU (gloo; ipc takes its staged path)
    torch.manual_seed(0)
    base = Net().cuda()
    ref, mine = DDP(copy.deepcopy(base), bucket_cap_mb=0.05), DDP(copy.deepcopy(base), bucket_cap_mb=0.05)
    state = hooks.CommState(algorithm)
    hooks.register(mine, state)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ref, mine)]
    side = torch.cuda.Stream()
    diffs = []
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(32, 256, generator=g).cuda(), torch.randn(32, 8, generator=g).cuda()
        for m, o in zip((ref, mine), opts):
            o.zero_grad()
            # Backward on a side stream: the hook must order itself after it, and DDP's
            # copy-out after the hook's work, without a device-wide synchronize.
            with torch.cuda.stream(side):
                nn.functional.mse_loss(m(x), y).backward()
            torch.cuda.current_stream().wait_stream(side)
            o.step()
        diffs.append(max(float((a - b).abs().max()) for a, b in zip(ref.parameters(), mine.parameters())))
    st = state.stats()
    state.close()
    return {"diffs": diffs, "digest": "".join(digest(q) for q in mine.parameters()), "iterations": st["iterations"]}


@pytest.mark.parametrize("algorithm", ["builtin", "ipc", "ring"])
def test_hook_on_cuda_matches_ddp(ranks, algorithm):
    res = ranks.run(2, cuda_parity, algorithm)
    for r in res:
        assert max(r["diffs"]) <= 1e-5, r
        assert r["iterations"] == 3, r
    assert res[0]["digest"] == res[1]["digest"]
