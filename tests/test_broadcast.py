"""The broadcast family (commlab.broadcast, dist.broadcast's contract): every registered
algorithm on 1-8 ranks, every dtype, every root, sizes not divisible by anything, empty,
strided and 0-dim tensors, async, sub-groups (src a global rank, or group_src); every
rank ends with the root's bits; a mismatch (size, dtype, root, algorithm, collective) is
the same CollectiveMismatchError on every rank, a rank that refuses its own arguments
makes its peers raise naming it, a failed rank makes every peer raise within two seconds.
The promises every family keeps alike run from tests/test_families.py, with this file's
calls."""

import cases
import pytest
import torch

import commlab
from commlab.algorithms import broadcast as family

ALGORITHMS = family.for_device("cpu")
DTYPES = cases.MOVED_DTYPES


def message(rank: int, n: int, dtype, root: int) -> torch.Tensor:
    return cases.seeded(f"{rank} {n} {dtype} {root}", n, dtype)


def sizes_for(p: int) -> list[int]:
    small = [0, 1, max(p - 1, 1), 7 * p + 3]
    return small if p >= 5 else small + [1000, 70_001]  # 70,001 B+: several chain segments, shm pieces


def sweep(rank, p, algorithm):
    failures = []
    for root in sorted({0, p - 1, p // 2}):
        for dtype in DTYPES:
            for n in sizes_for(p):
                t = message(rank, n, dtype, root)
                commlab.broadcast(t, src=root, algorithm=algorithm)
                if not torch.equal(t, message(root, n, dtype, root)):
                    failures.append(f"rank {rank} root {root} {dtype} n={n}: wrong")
    return failures


SWEEP = cases.family_sweep(ALGORITHMS, quick_at_3=("scatter_allgather", "shm"))


def layouts(rank, p, algorithm):
    out = []
    want = torch.arange(12, dtype=torch.float32).view(3, 4)
    # A strided tensor: a transposed view.
    base = want.clone() if rank == 1 else torch.zeros(3, 4)
    view = base.t()
    commlab.broadcast(view, src=1, algorithm=algorithm)
    if not torch.equal(base, want):
        out.append(f"strided: {base}")
    # A 0-dim tensor, and group_src.
    s = torch.tensor(float(rank))
    commlab.broadcast(s, group_src=2, algorithm=algorithm)
    if s.item() != 2.0:
        out.append(f"0-dim: {s}")
    # async: two calls in flight complete in order, with futures.
    a, b = torch.full((5,), float(rank)), torch.full((2,), float(rank))
    w1 = commlab.broadcast(a, src=0, algorithm=algorithm, async_op=True)
    w2 = commlab.broadcast(b, src=2, algorithm=algorithm, async_op=True)
    w2.wait()
    w1.get_future().wait()
    if not (torch.equal(a, torch.zeros(5)) and torch.equal(b, torch.full((2,), 2.0))):
        out.append("async results wrong")
    return out


def subgroups(rank, p, algorithm):
    t = torch.full((5,), rank, dtype=torch.int64)
    with cases.halves(rank) as (g, members):
        root = members[1]  # a global rank, the group's second
        commlab.broadcast(t, src=root, group=g, algorithm=algorithm)
    return torch.equal(t, torch.full((5,), root))


def mismatched(rank, p, algorithm, what):
    n = 8 if not (what == "size" and rank == 1) else 4
    dtype = torch.int32 if (what == "dtype" and rank == 1) else torch.float32
    root = 1 if (what == "root" and rank == 1) else 0
    alg = algorithm if not (what == "algorithm" and rank == 1) else ("binomial" if algorithm != "binomial" else "chain")
    if what == "collective" and rank == 1:
        return cases.mismatch_seen(p, lambda g: commlab.all_gather(torch.empty(p * n), torch.ones(n), group=g,
                                                             algorithm="ring" if alg != "shm" else alg))
    return cases.mismatch_seen(p, lambda g: commlab.broadcast(torch.ones(n, dtype=dtype), src=root, group=g, algorithm=alg))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("what", ["size", "dtype", "root", "algorithm", "collective"])
def test_a_mismatch_is_the_same_error_on_every_rank(ranks, algorithm, what):
    cases.assert_mismatch_alike(ranks.run(3, mismatched, algorithm, what), algorithm)


def wrong_root(rank, p, algorithm):
    src = 7 if rank == 1 else 0
    return cases.on_fresh_group(p, lambda g: commlab.broadcast(torch.ones(8), src=src, group=g, algorithm=algorithm))


def across_hosts(rank, p, hosts, algorithm):
    with cases.emulated_host(hosts[rank]) as group:
        bad = []
        for n in (1, 5, 70_001):  # 70,001 int8 / float64: below and above auto's 512 KiB switch
            for dtype in (torch.float64, torch.int8):
                t = message(rank, n, dtype, 1)
                commlab.broadcast(t, src=1, group=group, algorithm=algorithm)
                if not torch.equal(t, message(1, n, dtype, 1)):
                    bad.append(f"{dtype} n={n}")
        return bad, cases.picked_for("broadcast", algorithm, group, torch.int8)


# For tests/test_families.py, whose docstring says what each of these is for.
assert_sweep = cases.assert_none_failed
COLLECTIVE = "broadcast"
REFUSAL = (wrong_root, "src 7 is not a rank of this group")
FAULTS = cases.first_two_quick(("scatter_allgather", "sigkill"), ("shm", "sigint"), ("binomial", "sigint"),
    ("chain", "exception"), ("builtin", "sigkill"), ("chain", "error-in-call"), ("shm", "sigkill"))
ACROSS_HOSTS, AUTO_ACROSS_HOSTS = ["auto", "scatter_allgather"], ({"1 host": "shm"}, "auto")
UNKNOWN = lambda: commlab.broadcast(torch.empty(1), src=0, algorithm="nope")  # noqa: E731
