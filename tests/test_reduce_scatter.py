"""The reduce-scatter family (commlab.reduce_scatter, reduce_scatter_tensor's contract):
every registered algorithm on 1-8 ranks, every reducible dtype and op, sizes not divisible
by anything, empty, flat and stacked inputs, strided inputs and outputs, the in-place
convention, async, sub-groups; results are exact (integer-valued data) and the same
whatever the timing; a mismatch is the same CollectiveMismatchError on every rank, a rank
that refuses its own arguments makes its peers raise naming it, a failed rank makes every
peer raise within two seconds.
The promises every family keeps alike run from tests/test_families.py, with this file's
calls."""
import zlib

import cases
import pytest
import torch
import torch.distributed as dist

import commlab
from commlab.algorithms import reduce_scatter as family

ALGORITHMS = family.for_device("cpu")
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8]
OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "product": dist.ReduceOp.PRODUCT,
       "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}


def data(rank: int, n: int, dtype, op: str) -> torch.Tensor:
    """Small integers, exact in every dtype for every op (products stay tiny: 1 or 2)."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{rank} {n} {dtype} {op}".encode()))
    if op == "product":
        return torch.randint(1, 3, (n,), generator=g).to(dtype)
    low = 0 if dtype == torch.uint8 else -20
    return torch.randint(low, 20, (n,), generator=g).to(dtype)


def expected(p: int, n: int, dtype, op: str, rank: int) -> torch.Tensor:
    """Block `rank` of the reduction, in float64 (exact for these values), cast once."""
    xs = torch.stack([data(q, p * n, dtype, op).to(torch.float64) for q in range(p)])
    block = xs[:, rank * n:(rank + 1) * n]
    got = {"sum": block.sum(0), "product": block.prod(0), "min": block.min(0).values if n else block.sum(0),
           "max": block.max(0).values if n else block.sum(0), "avg": block.sum(0)}[op]
    if op == "avg":
        got = got / p if dtype.is_floating_point else torch.trunc(got / p)
    return got.to(dtype)


def sizes_for(p: int) -> list[int]:
    small = [0, 1, 3, 2 * p + 1]
    return small if p >= 5 else small + [1001, 4099]  # 4099 elements a block: several shm pieces


def sweep(rank, p, algorithm):
    failures = []
    for dtype in DTYPES:
        for op in OPS:
            for n in sizes_for(p):
                out = torch.full((n,), 7, dtype=dtype)
                commlab.reduce_scatter(out, data(rank, p * n, dtype, op), OPS[op], algorithm=algorithm)
                want = expected(p, n, dtype, op, rank)
                if not torch.equal(out, want):
                    bad = (out != want).nonzero()[:5].flatten().tolist()
                    failures.append(f"rank {rank} {dtype} {op} n={n}: wrong at {bad}")
        # Stacked input (p, n), as FSDP passes it, and the input left as it was.
        n = 5
        inp = data(rank, p * n, dtype, "sum").view(p, n)
        before = inp.clone()
        out = torch.empty(n, dtype=dtype)
        commlab.reduce_scatter(out, inp, algorithm=algorithm)
        if not torch.equal(out, expected(p, n, dtype, "sum", rank)) or not torch.equal(inp, before):
            failures.append(f"rank {rank} {dtype}: stacked input wrong or input changed")
    return failures


SWEEP = cases.family_sweep(ALGORITHMS, quick_at_3=("rh", "shm"))


def random_floats(rank, p, algorithm):
    """Rounding: every algorithm folds a block in a fixed order, so repeating a call gives
    the same bits, and the result is the sum to within rounding."""
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(p * 1000, generator=g)
    a, b = torch.empty(1000), torch.empty(1000)
    commlab.reduce_scatter(a, x, algorithm=algorithm)
    commlab.reduce_scatter(b, x, algorithm=algorithm)
    want = sum(torch.randn(p * 1000, generator=torch.Generator().manual_seed(q)).double() for q in range(p))
    return torch.equal(a, b) and torch.allclose(a.double(), want[rank * 1000:(rank + 1) * 1000], atol=1e-5)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_random_floats_repeat_bitwise(ranks, algorithm):
    assert all(ranks.run(3, random_floats, algorithm))


def layouts(rank, p, algorithm):
    out = []
    n = 6
    full = [torch.arange(p * n, dtype=torch.float32) + 1000 * q for q in range(p)]
    want = sum(full)[rank * n:(rank + 1) * n]
    # A strided input: every other element of a longer tensor.
    src = torch.zeros(2 * p * n)
    src[::2] = full[rank]
    got = torch.empty(n)
    commlab.reduce_scatter(got, src[::2], algorithm=algorithm)
    if not torch.equal(got, want):
        out.append(f"strided input: {got}")
    # A strided output: a column of a (n, 2) tensor.
    base = torch.zeros(n, 2)
    commlab.reduce_scatter(base[:, 1], full[rank].clone(), algorithm=algorithm)
    if not torch.equal(base[:, 1], want) or base[:, 0].any():
        out.append(f"strided output: {base}")
    # The in-place convention: the output is this rank's block of the input.
    whole = full[rank].clone()
    mine = whole[rank * n:(rank + 1) * n]
    commlab.reduce_scatter(mine, whole, algorithm=algorithm)
    if not torch.equal(mine, want):
        out.append(f"in place: {mine}")
    # AVG, and a 0-dim output.
    avg = torch.empty(n)
    commlab.reduce_scatter(avg, full[rank], dist.ReduceOp.AVG, algorithm=algorithm)
    if not torch.equal(avg, want / p):
        out.append(f"avg: {avg}")
    s = torch.tensor(0.0)
    commlab.reduce_scatter(s, torch.full((p,), float(rank)), algorithm=algorithm)
    if s.item() != sum(range(p)):
        out.append(f"0-dim: {s}")
    # async: two calls in flight complete in order, with futures.
    a, b = torch.empty(n), torch.empty(2)
    w1 = commlab.reduce_scatter(a, full[rank], algorithm=algorithm, async_op=True)
    w2 = commlab.reduce_scatter(b, torch.ones(2 * p), algorithm=algorithm, async_op=True)
    w2.wait()
    w1.get_future().wait()
    if not (torch.equal(a, want) and torch.equal(b, torch.full((2,), float(p)))):
        out.append("async results wrong")
    return out


def subgroups(rank, p, algorithm):
    out = torch.empty(5, dtype=torch.int64)
    with cases.halves(rank) as (g, members):
        commlab.reduce_scatter(out, torch.full((10,), rank, dtype=torch.int64), group=g, algorithm=algorithm)
    return torch.equal(out, torch.full((5,), sum(members)))


def mismatched(rank, p, algorithm, what):
    n = 8 if not (what == "size" and rank == 1) else 4
    dtype = torch.int32 if (what == "dtype" and rank == 1) else torch.float32
    op = dist.ReduceOp.MAX if (what == "op" and rank == 1) else dist.ReduceOp.SUM
    alg = algorithm if not (what == "algorithm" and rank == 1) else ("ring" if algorithm != "ring" else "rh")
    if what == "collective" and rank == 1:
        return cases.mismatch_seen(p, lambda g: commlab.all_gather(torch.empty(p * n), torch.ones(n), group=g,
                                                             algorithm="ring" if alg != "shm" else alg))
    return cases.mismatch_seen(p, lambda g: commlab.reduce_scatter(torch.empty(n, dtype=dtype), torch.ones(p * n, dtype=dtype),
                                                             op, group=g, algorithm=alg))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("what", ["size", "dtype", "op", "algorithm", "collective"])
def test_a_mismatch_is_the_same_error_on_every_rank(ranks, algorithm, what):
    cases.assert_mismatch_alike(ranks.run(3, mismatched, algorithm, what), algorithm)


def wrong_input(rank, p, algorithm):
    inp = torch.ones(p * 8 + (1 if rank == 1 else 0))
    return cases.on_fresh_group(p, lambda g: commlab.reduce_scatter(torch.empty(8), inp, group=g, algorithm=algorithm))


def across_hosts(rank, p, hosts, algorithm):
    with cases.emulated_host(hosts[rank]) as group:
        bad = []
        for n in (1, 5, 4099):  # 4099 float64 a block: several shm pieces of the tests' 16 KiB segments
            for dtype in (torch.float64, torch.int32):
                out = torch.empty(n, dtype=dtype)
                commlab.reduce_scatter(out, data(rank, p * n, dtype, "sum"), group=group, algorithm=algorithm)
                if not torch.equal(out, expected(p, n, dtype, "sum", rank)):
                    bad.append(f"{dtype} n={n}")
        return bad, cases.picked_for("reduce_scatter", algorithm, group, torch.int32, dist.ReduceOp.SUM)



def test_a_dtype_it_cannot_reduce_is_clear():
    with pytest.raises(commlab.UnsupportedError, match="dtype torch.bool is not supported"):
        commlab.reduce_scatter(torch.empty(1, dtype=torch.bool), torch.ones(1, dtype=torch.bool))

# For tests/test_families.py, whose docstring says what each of these is for.
assert_sweep = cases.assert_none_failed
COLLECTIVE = "reduce_scatter"
REFUSAL = (wrong_input, "needs world size 3")
FAULTS = cases.first_two_quick(("rh", "sigkill"), ("shm", "sigint"), ("ring", "sigint"), ("direct", "exception"),
    ("builtin", "sigkill"), ("ring", "error-in-call"), ("shm", "sigkill"))
ACROSS_HOSTS, AUTO_ACROSS_HOSTS = ["auto", "hier", "rh"], ({"1x3": "ring", "1 host": "shm"}, "hier")
UNKNOWN = lambda: commlab.reduce_scatter(torch.empty(1), torch.ones(1), algorithm="nope")  # noqa: E731
