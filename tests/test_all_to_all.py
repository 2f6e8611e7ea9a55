"""The all-to-all family (commlab.all_to_all, dist.all_to_all_single's contract): every
registered algorithm on 1-8 ranks, every dtype, even and uneven splits (empty blocks,
ranks that send or receive nothing), rows of several elements, strided and conj views,
async, sub-groups; every block lands where torch's would; splits that disagree, a size,
dtype, algorithm or collective mismatch are the same CollectiveMismatchError on every
rank before any byte lands, a rank that refuses its own arguments makes its peers raise
naming it, a failed rank makes every peer raise within two seconds.
The promises every family keeps alike run from tests/test_families.py, with this file's
calls."""

import cases
import pytest
import torch
import torch.distributed as dist

import commlab
from commlab.algorithms import all_to_all as family

ALGORITHMS = family.for_device("cpu")
DTYPES = cases.MOVED_DTYPES


def block(src: int, dst: int, rows: int, row: int, dtype) -> torch.Tensor:
    """What rank src sends rank dst: rows × row elements, known to every rank."""
    return cases.seeded(f"{src} {dst} {rows} {row} {dtype}", (rows, row), dtype)


def splits_of(kind: str, p: int, n: int):
    """rows[j][q]: rows rank j sends rank q."""
    if kind == "even":
        return [[n] * p for _ in range(p)]
    if kind == "uneven":  # every pair its own size, zeros included
        return [[(j * 7 + q * 3 + n) % (n + 2) for q in range(p)] for j in range(p)]
    if kind == "one sender":  # only rank 0 sends; the others take part with nothing
        return [[n + q if j == 0 else 0 for q in range(p)] for j in range(p)]
    raise ValueError(kind)


def exchange(rank, p, rows, row, dtype, algorithm, even_call=False, group=None):
    inp = torch.cat([block(rank, q, rows[rank][q], row, dtype) for q in range(p)])
    want = torch.cat([block(j, rank, rows[j][rank], row, dtype) for j in range(p)])
    out = torch.empty_like(want)
    if even_call:
        commlab.all_to_all(out, inp, group=group, algorithm=algorithm)
    else:
        commlab.all_to_all(out, inp, [rows[j][rank] for j in range(p)], rows[rank], group=group, algorithm=algorithm)
    return torch.equal(out, want)


def sweep(rank, p, algorithm):
    failures = []
    for kind in ("even", "uneven", "one sender"):
        for dtype in DTYPES:
            for n, row in ((0, 1), (1, 1), (3, 5), (1000, 3)) if p < 5 else ((0, 1), (2, 3), (70, 3)):
                rows = splits_of(kind, p, n)
                if not exchange(rank, p, rows, row, dtype, algorithm, even_call=(kind == "even" and n % 2 == 1)):
                    failures.append(f"rank {rank} {kind} {dtype} rows={n} row={row}: wrong")
    return failures


SWEEP = cases.family_sweep(ALGORITHMS, quick_at_3=("bruck", "shm"))


def large(rank, p, algorithm):
    # Blocks larger than a shared-memory piece (several pieces), uneven: 3 MiB to 0 bytes.
    rows = [[(1 << 20) * ((j + q) % 3) for q in range(p)] for j in range(p)]
    return exchange(rank, p, rows, 1, torch.float32 if algorithm != "bruck" else torch.int8, algorithm)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_blocks_larger_than_a_piece(ranks, algorithm):
    assert all(ranks.run(3, large, algorithm, timeout=300))


def layouts(rank, p, algorithm):
    out = []
    # Strided input and output: transposed views whose dim 0 is what is split.
    base = torch.arange(4 * p * 3, dtype=torch.float32).view(3, 4 * p) + 1000 * rank
    inp = base.t()  # (4p, 3), not contiguous
    got = torch.zeros(3, 4 * p).t()
    commlab.all_to_all(got, inp, algorithm=algorithm)
    want = torch.cat([(torch.arange(4 * p * 3, dtype=torch.float32).view(3, 4 * p) + 1000 * j).t()[4 * rank:4 * rank + 4]
                      for j in range(p)])
    if not torch.equal(got, want):
        out.append("strided")
    # conj and neg views travel as their values.
    z = (torch.arange(2 * p, dtype=torch.float32) + 1j * rank).to(torch.complex64)
    got = torch.empty(2 * p, dtype=torch.complex64)
    commlab.all_to_all(got, z.conj(), algorithm=algorithm)
    want = torch.cat([(torch.arange(2 * p, dtype=torch.float32) - 1j * j)[2 * rank:2 * rank + 2] for j in range(p)])
    if not torch.equal(got, want.to(torch.complex64)):
        out.append(f"conj: {got}")
    # async: two calls in flight complete in order, with futures.
    a, b = torch.full((p,), float(rank)), torch.full((2 * p,), float(rank + 10))
    oa, ob = torch.empty(p), torch.empty(2 * p)
    w1 = commlab.all_to_all(oa, a, algorithm=algorithm, async_op=True)
    w2 = commlab.all_to_all(ob, b, algorithm=algorithm, async_op=True)
    w2.wait()
    w1.get_future().wait()
    if not (torch.equal(oa, torch.arange(p, dtype=torch.float32))
            and torch.equal(ob, (torch.arange(p, dtype=torch.float32) + 10).repeat_interleave(2))):
        out.append("async results wrong")
    return out


def subgroups(rank, p, algorithm):
    with cases.halves(rank) as (g, _):
        return exchange(rank // 2, 2, splits_of("uneven", 2, 3), 2, torch.int64, algorithm, group=g)


def mismatched(rank, p, algorithm, what):
    n = 4
    dtype = torch.int32 if (what == "dtype" and rank == 1) else torch.float32
    alg = algorithm if not (what == "algorithm" and rank == 1) else ("bruck" if algorithm != "bruck" else "pairwise")
    send, recv = [n] * p, [n] * p
    if what == "splits" and rank == 1:
        send = [n, n, n + 1]  # rank 2 expects n from rank 1
    if what == "size" and rank == 1:
        send = recv = [n - 1] * p  # every peer of rank 1 expects n
    g = dist.new_group(list(range(p)))  # a failed group stays failed: not the pool's default one
    try:
        if what == "collective" and rank == 1:
            commlab.all_gather(torch.empty(p * n), torch.ones(n), group=g, algorithm="ring" if alg != "shm" else alg)
        else:
            out = torch.full((sum(recv),), -1.0, dtype=dtype)
            commlab.all_to_all(out, torch.ones(sum(send), dtype=dtype), recv, send, group=g, algorithm=alg)
    except commlab.CollectiveMismatchError as e:
        return "mismatch", str(e), bool((out == -1).all()) if what != "collective" or rank != 1 else True
    except commlab.CommlabError as e:
        return type(e).__name__, str(e), None
    finally:
        dist.destroy_process_group(g)
    return "returned", "", None


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("what", ["splits", "size", "dtype", "algorithm", "collective"])
def test_a_mismatch_is_the_same_error_on_every_rank(ranks, algorithm, what):
    got = ranks.run(3, mismatched, algorithm, what)
    # shm's record texts say "this rank"; splits are agreed as a matrix even there
    cases.assert_mismatch_alike(got, algorithm, shm_texts=() if what == "splits" else ("shm", "auto"))
    assert all(untouched for _, _, untouched in got), got  # before any byte landed
    if what in ("splits", "size"):
        assert "splits that disagree" in got[0][1], got


def bad_splits(rank, p, algorithm):
    splits = [1, 1] if rank == 1 else [1] * p  # rank 1 gives two splits for three ranks
    return cases.on_fresh_group(p, lambda g: commlab.all_to_all(torch.empty(p), torch.ones(p), [1] * p, splits, group=g,
                                                          algorithm=algorithm))


def one_rank_refusals(rank, p):
    said = []
    for out, inp, osp, isp in ((torch.empty(2), torch.empty(3), None, None),  # 3 rows out, 2 in
                               (torch.empty(()), torch.empty(2), None, None),  # 0-dim
                               (torch.empty(2), torch.empty(2), [2], [1])):  # splits do not add up
        try:
            commlab.all_to_all(out, inp, osp, isp, algorithm="pairwise")
            said.append("returned")
        except commlab.UnsupportedError as e:
            said.append(str(e))
    return said


def test_arguments_a_rank_refuses_on_its_own(ranks):
    said = ranks.run(1, one_rank_refusals)[0]
    assert "of one rank sends 3 elements to itself and expects 2" in said[0], said
    assert "output needs at least one dimension" in said[1], said
    assert "input_split_sizes add up to 1 rows, the input has 2" in said[2], said


def across_hosts(rank, p, hosts, algorithm):
    with cases.emulated_host(hosts[rank]) as group:
        bad = []
        for n in (1, 3000):  # int8 blocks below and above auto's switch
            for kind in ("even", "uneven"):
                if not exchange(rank, p, splits_of(kind, p, n), 1, torch.int8, algorithm, group=group):
                    bad.append(f"{kind} n={n}")
        return bad, cases.picked_for("all_to_all", algorithm, group, torch.int8)


# For tests/test_families.py, whose docstring says what each of these is for.
assert_sweep = cases.assert_none_failed
COLLECTIVE = "all_to_all"
REFUSAL = (bad_splits, "input_split_sizes must be 3 non-negative ints")
FAULTS = cases.first_two_quick(("pairwise", "sigkill"), ("shm", "sigint"), ("bruck", "sigint"),
    ("bruck", "exception"), ("builtin", "sigkill"), ("pairwise", "error-in-call"), ("shm", "sigkill"))
ACROSS_HOSTS, AUTO_ACROSS_HOSTS = ["auto", "bruck"], ({"1 host": "shm"}, "auto")
UNKNOWN = lambda: commlab.all_to_all(torch.empty(1), torch.empty(1), algorithm="nope")  # noqa: E731
