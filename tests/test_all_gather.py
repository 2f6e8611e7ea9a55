"""The all-gather family (commlab.all_gather, all_gather_into_tensor's contract): every
registered algorithm on 1-8 ranks, every dtype, sizes not divisible by anything, empty,
flat and stacked outputs, strided inputs and outputs, the in-place convention, async,
sub-groups; a mismatch is the same CollectiveMismatchError on every rank, a rank that
refuses its own arguments makes its peers raise naming it.
The promises every family keeps alike run from tests/test_families.py, with this file's
calls."""

import cases
import pytest
import torch
import torch.distributed as dist

import commlab
from commlab.algorithms import all_gather as family

ALGORITHMS = family.for_device("cpu")
DTYPES = cases.MOVED_DTYPES


def block(rank: int, n: int, dtype, salt: str = "") -> torch.Tensor:
    return cases.seeded(f"{rank} {n} {dtype} {salt}", n, dtype)


def sizes_for(p: int) -> list[int]:
    small = [0, 1, max(p - 1, 1), 7 * p + 3]
    return small if p >= 8 else small + [1000, 4099]  # 4099 B+: several shm pieces (16 KiB segments)


def sweep(rank, p, algorithm):
    failures, digests = [], {}
    for dtype in DTYPES:
        for n in sizes_for(p):
            want = torch.cat([block(r, n, dtype) for r in range(p)])
            out = torch.full((p * n,), 7, dtype=dtype) if dtype != torch.bool else torch.zeros(p * n, dtype=dtype)
            commlab.all_gather(out, block(rank, n, dtype), algorithm=algorithm)
            if not torch.equal(out, want):
                bad = (out != want).nonzero()[:5].flatten().tolist()
                failures.append(f"rank {rank} {dtype} n={n}: wrong at {bad}")
            digests[f"{dtype} {n}"] = out.view(torch.uint8).sum().item() if n else 0
            # Stacked output (p, n), as FSDP passes it.
            stacked = torch.empty(p, n, dtype=dtype)
            commlab.all_gather(stacked, block(rank, n, dtype), algorithm=algorithm)
            if not torch.equal(stacked.view(-1), want):
                failures.append(f"rank {rank} {dtype} n={n}: stacked output wrong")
    return failures, digests


def assert_sweep(results):
    cases.assert_none_failed([fails for fails, _ in results])
    assert all(d == results[0][1] for _, d in results)


SWEEP = cases.family_sweep(ALGORITHMS)


def layouts(rank, p, algorithm):
    out = []
    n = 6
    want = torch.cat([torch.arange(n, dtype=torch.float32) + 100 * r for r in range(p)])
    # A strided input: every other element of a longer tensor.
    src = torch.zeros(2 * n)
    src[::2] = torch.arange(n, dtype=torch.float32) + 100 * rank
    flat = torch.empty(p * n)
    commlab.all_gather(flat, src[::2], algorithm=algorithm)
    if not torch.equal(flat, want):
        out.append(f"strided input: {flat}")
    # A strided output (a transposed (n, p) view whose logical order is rank-major).
    base = torch.zeros(n, p)
    view = base.t()  # (p, n), not contiguous
    commlab.all_gather(view, torch.arange(n, dtype=torch.float32) + 100 * rank, algorithm=algorithm)
    if not torch.equal(view.reshape(-1), want):
        out.append(f"strided output: {view}")
    # The in-place convention: the input is this rank's block of the output.
    whole = torch.zeros(p * n)
    mine = whole[rank * n:(rank + 1) * n]
    mine.copy_(torch.arange(n, dtype=torch.float32) + 100 * rank)
    commlab.all_gather(whole, mine, algorithm=algorithm)
    if not torch.equal(whole, want):
        out.append(f"in place: {whole}")
    # A 0-dim input.
    s = torch.tensor(float(rank))
    got = torch.empty(p)
    commlab.all_gather(got, s, algorithm=algorithm)
    if not torch.equal(got, torch.arange(p, dtype=torch.float32)):
        out.append(f"0-dim: {got}")
    # async: two calls in flight complete in order, with futures.
    a, b = torch.empty(p * n), torch.empty(p * 2)
    w1 = commlab.all_gather(a, torch.arange(n, dtype=torch.float32) + 100 * rank, algorithm=algorithm, async_op=True)
    w2 = commlab.all_gather(b, torch.full((2,), float(rank)), algorithm=algorithm, async_op=True)
    w2.wait()
    w1.get_future().wait()
    if not (torch.equal(a, want) and torch.equal(b, torch.arange(p).repeat_interleave(2).float())):
        out.append("async results wrong")
    return out


def subgroups(rank, p, algorithm):
    out = torch.empty(2 * 5, dtype=torch.int64)
    with cases.halves(rank) as (g, members):
        commlab.all_gather(out, torch.full((5,), rank, dtype=torch.int64), group=g, algorithm=algorithm)
    return torch.equal(out, torch.tensor(members).repeat_interleave(5))


def mismatched(rank, p, algorithm, what):
    n = 8 if not (what == "size" and rank == 1) else 4
    dtype = torch.int32 if (what == "dtype" and rank == 1) else torch.float32
    alg = algorithm if not (what == "algorithm" and rank == 1) else ("ring" if algorithm != "ring" else "rd")
    if what == "collective" and rank == 1:
        return cases.mismatch_seen(p, lambda g: commlab.all_reduce(torch.ones(n), group=g, algorithm=alg))
    return cases.mismatch_seen(p, lambda g: commlab.all_gather(torch.empty(p * n, dtype=dtype), torch.ones(n, dtype=dtype),
                                                         group=g, algorithm=alg))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("what", ["size", "dtype", "algorithm", "collective"])
def test_a_mismatch_is_the_same_error_on_every_rank(ranks, algorithm, what):
    cases.assert_mismatch_alike(ranks.run(3, mismatched, algorithm, what), algorithm)


def wrong_output(rank, p, algorithm):
    out = torch.empty(p * 8 + (1 if rank == 1 else 0))
    return cases.on_fresh_group(p, lambda g: commlab.all_gather(out, torch.ones(8), group=g, algorithm=algorithm))


@pytest.mark.slow
def test_a_frozen_rank_is_named(monkeypatch):
    monkeypatch.setenv("COMMLAB_PEER_TIMEOUT", "2")
    from commlab.diagnostics.drill import drill

    got = drill("rd", "sigstop", world_size=3, collective="all_gather")
    for r, o in got["survivors"].items():
        assert "stopped responding" in o["msg"] and o["after"] < 4.5, (r, o)


def across_hosts(rank, p, hosts, algorithm):
    with cases.emulated_host(hosts[rank]) as group:
        bad = []
        for n in (1, 5, 4099):  # 4099 float64: several shm pieces of the tests' 16 KiB segments
            for dtype in (torch.float64, torch.int8):
                want = torch.cat([block(r, n, dtype) for r in range(p)])
                out = torch.empty(p * n, dtype=dtype)
                commlab.all_gather(out, block(rank, n, dtype), group=group, algorithm=algorithm)
                if not torch.equal(out, want):
                    bad.append(f"{dtype} n={n}")
        return bad, cases.picked_for("all_gather", algorithm, group, torch.int8)


def refused_alike_then_usable(rank, p):
    import os

    os.environ["COMMLAB_HOST_ID"] = f"h{rank % 2}"
    try:
        group = dist.new_group()
        out = torch.empty(p * 4)
        try:
            commlab.all_gather(out, torch.ones(4), group=group, algorithm="shm")
            first = "returned"
        except commlab.CommlabError as e:
            first = type(e).__name__
        commlab.all_gather(out, torch.full((4,), float(rank)), group=group, algorithm="ring")
        ok = torch.equal(out, torch.arange(p, dtype=torch.float32).repeat_interleave(4))
        dist.destroy_process_group(group)
        return first, ok
    finally:
        del os.environ["COMMLAB_HOST_ID"]


def test_a_refusal_every_rank_shares_leaves_the_group_usable(ranks):
    # shm across two (emulated) hosts refuses on every rank alike: the group stays usable.
    # It gave the group up before: the first rank's refusal became the others' PeerError
    # and every later call on the group raised it, as tests/test_twohost.py showed
    # (docs/measurements.md, "What the tests rest on").
    assert ranks.run(4, refused_alike_then_usable) == [("UnsupportedError", True)] * 4


@pytest.mark.parametrize("algorithm", family.names())
def test_every_cost_and_two_level_schedule_is_computable(algorithm):
    # rd's two-level schedule raised ValueError (a 5-value unpack into 4 names) for every
    # power-of-two layout across hosts; nothing called it.
    alg = family.get(algorithm)
    for p in (2, 3, 4, 8):
        assert alg.cost(p, 1 << 20).bytes_sent > 0
    for hosts, per_host in ((1, 4), (2, 2), (2, 4), (3, 2)):
        stages = alg.stages(hosts, per_host, 1 << 20)
        assert stages is None or all(s.steps >= 0 and s.bytes >= 0 for s in stages), (hosts, per_host, stages)


def test_recursive_doublings_two_level_schedule():
    # 2 hosts of 2 ranks: distance 1 stays on a host (1 step, a quarter of n), distance 2
    # crosses (1 step, half of n per rank, both ranks of a host at once on its link).
    host, link = family.get("rd").stages(2, 2, 1 << 20)
    assert (host.level, host.steps, host.bytes) == ("host", 1, (1 << 20) / 4)
    assert (link.level, link.steps, link.bytes, link.rank_bytes) == ("link", 1, 2 * (1 << 20) / 2, (1 << 20) / 2)


# For tests/test_families.py, whose docstring says what each of these is for.
COLLECTIVE = "all_gather"
REFUSAL = (wrong_output, "needs world size 3")
FAULTS = cases.first_two_quick(("ring", "sigkill"), ("shm", "sigint"), ("rd", "sigint"), ("direct", "exception"),
    ("builtin", "sigkill"), ("ring", "error-in-call"), ("shm", "sigkill"))
ACROSS_HOSTS, AUTO_ACROSS_HOSTS = ["hier", "auto"], ({"1x3": "ring", "1 host": "shm"}, "hier")
UNKNOWN = lambda: commlab.all_gather(torch.empty(1), torch.empty(1), algorithm="nope")  # noqa: E731
