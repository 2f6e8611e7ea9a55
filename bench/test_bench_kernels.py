"""Single-process reduction kernels: commlab._C.reduce_n (one pass over N inputs)
against a chain of torch element-wise ops, as an N-way reduction on the root would do."""
import pytest
import torch

from commlab.core import ext as _ext
from commlab.core.reduction import Op, combine_

N_INPUTS = 4
NUMEL = 4 << 20  # 16 MiB of float32 per input


def _inputs(dtype):
    return [torch.rand(NUMEL).to(dtype) for _ in range(N_INPUTS)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reduce_n_fused(benchmark, dtype):
    C = _ext.require()
    xs, out = _inputs(dtype), torch.empty(NUMEL, dtype=dtype)
    benchmark.group = f"reduce {N_INPUTS}-way {dtype}"
    benchmark(C.reduce_n, out, xs, int(Op.SUM))
    if benchmark.disabled:
        return
    benchmark.extra_info["GBps_read"] = N_INPUTS * NUMEL * xs[0].element_size() / benchmark.stats.stats.median / 1e9


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reduce_torch_chain(benchmark, dtype):
    xs, out = _inputs(dtype), torch.empty(NUMEL, dtype=dtype)

    def chain():
        out.copy_(xs[0])
        for x in xs[1:]:
            combine_(out, x, Op.SUM)

    benchmark.group = f"reduce {N_INPUTS}-way {dtype}"
    benchmark(chain)
    if benchmark.disabled:
        return
    benchmark.extra_info["GBps_read"] = N_INPUTS * NUMEL * xs[0].element_size() / benchmark.stats.stats.median / 1e9
