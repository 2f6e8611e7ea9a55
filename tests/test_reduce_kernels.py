"""commlab._C.reduce_n (the fused N-way reduction) against torch, single process."""
import pytest
import torch
from cases import DTYPES, make_input

from commlab.core import ext as _ext
from commlab.core.reduction import Op, reduce_into

C = _ext.require()


@pytest.fixture(params=C.simd_levels())
def simd(request):
    """Every instruction-set build of the loop this CPU can run."""
    before = C.simd_level()
    C.set_simd_level(request.param)
    yield request.param
    C.set_simd_level(before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", [Op.SUM, Op.PRODUCT, Op.MIN, Op.MAX])
@pytest.mark.parametrize("n_inputs", [1, 2, 5])
def test_reduce_n_matches_torch(simd, dtype, op, n_inputs):
    numel = 3000  # spans several 1024-element blocks plus a tail
    inputs = [make_input(k + 1, k, numel, dtype, op.name) for k in range(n_inputs)]
    # Reference: left fold in list order, in float32 for 16-bit floats (one rounding).
    wide = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    acc = inputs[0].to(wide).clone()
    fn = {Op.SUM: torch.add, Op.PRODUCT: torch.mul, Op.MIN: torch.minimum, Op.MAX: torch.maximum}[op]
    for x in inputs[1:]:
        acc = fn(acc, x.to(wide))
    out = torch.empty(numel, dtype=dtype)
    C.reduce_n(out, inputs, int(op))
    assert torch.equal(out, acc.to(dtype))


def test_reduce_n_output_may_alias_any_input():
    xs = [torch.arange(2000, dtype=torch.float32) * (k + 1) for k in range(3)]
    want = xs[0] + xs[1] + xs[2]
    reduce_into(xs[1], [xs[0], xs[1].clone(), xs[2]], Op.SUM)
    assert torch.equal(xs[1], want)
    ys = [torch.arange(50, dtype=torch.int64) + k for k in range(3)]
    C.reduce_n(ys[2], ys, int(Op.MAX))
    assert torch.equal(ys[2], torch.arange(50) + 2)


def test_simd_levels_known():
    assert C.simd_levels()[0] == "scalar" and C.simd_level() in C.simd_levels()
    with pytest.raises(RuntimeError, match="unknown SIMD level"):
        C.set_simd_level("sse9")


def test_reduce_n_nan_propagates_in_min_max(simd):
    a = torch.tensor([1.0, float("nan"), 3.0])
    b = torch.tensor([float("nan"), 2.0, 0.0])
    for op, want in [(Op.MIN, [float("nan"), float("nan"), 0.0]), (Op.MAX, [float("nan"), float("nan"), 3.0])]:
        out = torch.empty(3)
        C.reduce_n(out, [a, b], int(op))
        assert torch.equal(out.isnan(), torch.tensor(want).isnan())
        assert out[2].item() == want[2]


def test_reduce_n_rejects_bad_input():
    with pytest.raises(RuntimeError, match="size mismatch"):
        C.reduce_n(torch.empty(3), [torch.ones(3), torch.ones(4)], 0)
    with pytest.raises(RuntimeError, match="dtype mismatch"):
        C.reduce_n(torch.empty(3), [torch.ones(3, dtype=torch.float64)], 0)
    with pytest.raises(RuntimeError, match="op code"):
        C.reduce_n(torch.empty(3), [torch.ones(3)], 7)
    with pytest.raises(RuntimeError, match="dtype"):
        C.reduce_n(torch.empty(3, dtype=torch.bool), [torch.ones(3, dtype=torch.bool)], 0)


def test_extension_build_facts():
    import commlab

    assert C.version() == commlab.__version__
    assert isinstance(C.has_cuda(), bool)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_n_cuda_matches_cpu(dtype):
    if not C.has_cuda():
        pytest.skip("commlab._C built without CUDA")
    inputs = [make_input(k + 7, k, 100_003, dtype, "SUM") for k in range(4)]
    cpu = torch.empty_like(inputs[0])
    C.reduce_n(cpu, inputs, int(Op.SUM))
    dev = [x.cuda() for x in inputs]
    out = torch.empty_like(dev[0])
    C.reduce_n(out, dev, int(Op.SUM))
    assert torch.equal(out.cpu(), cpu)


def test_python_mirrors_the_extension_codes():
    """csrc/common/codes.h is the one source of dtype, op and mode codes; the Python
    enums that mirror it must agree with what the extension was built with."""
    from commlab.core.collectives import KIND
    from commlab.core.reduction import SUPPORTED_DTYPES
    from commlab.transports import ipc, shm

    codes = _ext.require().codes()
    assert {o.name: int(o) for o in Op if o is not Op.AVG} == codes["op"]
    assert KIND == codes["kind"]
    assert int(Op.AVG) == codes["avg_record"]  # Context.recorded() hands the transports Op.AVG's value
    assert {m.name: int(m) for m in shm.Mode} == codes["shm_mode"]
    assert {m.name: int(m) for m in ipc.Mode} == codes["ipc_mode"]
    assert sorted(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES) == sorted(codes["dtype"])
