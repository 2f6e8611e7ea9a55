"""Ranks that call differently on the point-to-point transport (every pure algorithm,
gloo's own all-reduce behind `builtin`, hier's link stage): the same
CollectiveMismatchError on every rank within seconds, before any byte of the call moves —
never a rank that returns with wrong data, never a process aborted by gloo's size check.

Before the call record was agreed: `ps` with 1 MiB on rank 0 and 512 KiB on the others
returned success on rank 0 (gloo let the short message land in the long receive) and
killed ranks 1 and 2 with SIGABRT (gloo::EnforceNotMet)."""
import os
import time

import pytest
import torch
import torch.distributed as dist

import commlab
from commlab.measure.pools import RankPool

P2P_ALGORITHMS = ["ps", "ps_sharded", "ring", "rhd", "rd", "direct", "builtin"]
MiB = 1 << 20


def differing_call(rank, p, algorithm, what, hosts=None):
    """Rank 0 calls differently from the others in `what`; every rank reports what it
    raised (or the data it returned) and when."""
    if hosts:
        os.environ["COMMLAB_HOST_ID"] = f"h{hosts[rank]}"
    group = dist.new_group()
    numel, dtype, op = MiB // 8, torch.float32, dist.ReduceOp.SUM  # 512 KiB
    if rank == 0:
        if what == "size":
            numel = MiB // 4  # 1 MiB
        elif what == "dtype":
            dtype = torch.float64
        elif what == "op":
            op = dist.ReduceOp.MAX
    ok = torch.ones(16)
    commlab.all_reduce(ok, group=group, algorithm=algorithm)  # a healthy call first: later calls are checked too
    x = torch.ones(numel, dtype=dtype)
    t0 = time.monotonic()
    try:
        commlab.all_reduce(x, op=op, group=group, algorithm=algorithm)
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return {"type": type(e).__name__, "msg": str(e), "seconds": time.monotonic() - t0,
                "first": ok[0].item()}
    return {"type": None, "sum": float(x.double().sum()), "seconds": time.monotonic() - t0}


def _every_rank_raises_the_same_mismatch(res, p):
    for r in range(p):
        assert res[r].status == "ok", f"rank {r}: {res[r].status} (alive {res[r].alive}): {res[r].error[-2000:]}"
    got = [res[r].result for r in range(p)]
    for r, g in enumerate(got):
        assert g["type"] == "CollectiveMismatchError", (r, g)
        assert g["seconds"] < 2.0, (r, g)
        assert g["first"] == p  # the healthy call before it was right
    assert len({g["msg"] for g in got}) == 1, [g["msg"] for g in got]  # the same text everywhere
    return got[0]["msg"]


@pytest.mark.parametrize("algorithm", [a if a == "ps" else pytest.param(a, marks=pytest.mark.slow)
                                       for a in P2P_ALGORITHMS])  # the quick tier: ps, the case
def test_a_size_mismatch_is_the_same_error_on_every_rank(algorithm):
    res = RankPool(3, pg_timeout_s=30).outcomes(differing_call, algorithm, "size", timeout=60)
    msg = _every_rank_raises_the_same_mismatch(res, 3)
    assert "rank 0: all_reduce of 262144 float32 SUM" in msg and "rank 1: all_reduce of 131072 float32 SUM" in msg, msg
    assert "caught before any data moved" in msg


@pytest.mark.slow
@pytest.mark.parametrize("what", ["dtype", "op"])
@pytest.mark.parametrize("algorithm", ["ring", "builtin"])
def test_dtype_and_op_mismatches_too(algorithm, what):
    res = RankPool(3, pg_timeout_s=30).outcomes(differing_call, algorithm, what, timeout=60)
    msg = _every_rank_raises_the_same_mismatch(res, 3)
    assert {"dtype": "float64", "op": "MAX"}[what] in msg, msg


@pytest.mark.parametrize("algorithm", ["hier", pytest.param("auto", marks=pytest.mark.slow)])
def test_across_emulated_hosts(algorithm):
    """Two hosts: shared memory inside each, the point-to-point link stage between them;
    a size that differs between the hosts is caught before the link stage moves a byte."""
    res = RankPool(4, pg_timeout_s=30).outcomes(differing_call, algorithm, "size", [0, 0, 1, 1], timeout=60)
    _every_rank_raises_the_same_mismatch(res, 4)


def early_check(rank, p, late_s):
    """Rank 0 checks a call while its peer is still away; both then check it and run a
    healthy call. Returns how long rank 0's check took and the healthy call's sum."""
    from commlab.core import groups
    from commlab.core.reduction import Op
    from commlab.transports.p2p import P2P
    from commlab.transports.records import CallRecord

    group = dist.new_group()
    x = torch.ones(1024)
    commlab.all_reduce(x, group=group, algorithm="ring")  # sets the group up on every rank
    p2p = P2P(groups.resolve(group), "ring")
    if rank == 1:
        time.sleep(late_s)
    t0 = time.monotonic()
    p2p.agree(CallRecord("all_reduce", 1024, torch.float32, Op.SUM, "ring"), lambda: ("ring",))
    seconds = time.monotonic() - t0
    y = torch.full((1024,), float(rank + 1))
    commlab.all_reduce(y, group=group, algorithm="ring")
    return {"seconds": seconds, "sum": y[0].item()}


def test_the_check_waits_for_no_peer():
    """The check of a point-to-point call on one host is a record in shared memory that
    the later rank compares: the earlier rank goes on to its first transfer at once
    (before, every call waited there for its slowest peer, a rendezvous of its own that
    doubled a small call's time)."""
    res = RankPool(2, pg_timeout_s=30).outcomes(early_check, 0.6, timeout=60)
    got = [res[r].result for r in range(2)]
    assert all(res[r].status == "ok" for r in range(2)), [res[r].error[-1500:] for r in range(2)]
    assert got[0]["seconds"] < 0.3, got  # it did not wait out rank 1's 0.6 s
    assert [g["sum"] for g in got] == [3.0, 3.0]  # the group still works, with the right data


def mixed_transports(rank, p, warm):
    """Rank 0 calls through shared memory, the others point-to-point, on one group."""
    group = dist.new_group()
    if warm:
        commlab.all_reduce(torch.ones(16), group=group, algorithm="ring")
    x = torch.ones(4096)
    t0 = time.monotonic()
    try:
        commlab.all_reduce(x, group=group, algorithm="shm" if rank == 0 else "ring")
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return {"type": type(e).__name__, "msg": str(e), "seconds": time.monotonic() - t0}
    return {"type": None, "sum": float(x.sum()), "seconds": time.monotonic() - t0}


@pytest.mark.parametrize("warm", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["after-a-call", "first-call"])
def test_a_rank_in_another_transport_is_a_mismatch_on_every_rank(warm):
    """A point-to-point record meets a shared-memory call: the shared-memory rank finds it
    in its peer's slot, and the point-to-point ranks, which wait in a transfer (or in the
    connection's set-up) for a rank that never comes, read its give-up from shared memory."""
    res = RankPool(3, pg_timeout_s=30).outcomes(mixed_transports, warm, timeout=60)
    for r in range(3):
        assert res[r].status == "ok", f"rank {r}: {res[r].status}: {res[r].error[-2000:]}"
        g = res[r].result
        assert g["type"] == "CollectiveMismatchError", (r, g)
        assert g["seconds"] < 2.0, (r, g)
    msgs = {res[r].result["msg"] for r in range(3)}
    assert len(msgs) == 1, msgs  # the same text everywhere
    # A first call differs already in the group's set-up (shared memory's on one rank,
    # the check's route on the others); a later one in the records.
    assert ("by a point-to-point algorithm" if warm else "shm setup") in msgs.pop()


def three_way(rank, p, algorithm):
    """Rank 0's call is twice the others' on one group: its peers meet the difference in
    different pairs (rank 1 with rank 0, rank 2 with rank 0)."""
    group = dist.new_group()
    commlab.all_reduce(torch.ones(16), group=group, algorithm=algorithm)
    x = torch.ones(2048 if rank == 0 else 1024)
    try:
        commlab.all_reduce(x, group=group, algorithm=algorithm)
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return {"type": type(e).__name__, "msg": str(e)}
    return {"type": None}


@pytest.mark.parametrize("algorithm", ["shm", pytest.param("ring", marks=pytest.mark.slow)])
def test_ranks_that_meet_a_difference_in_different_pairs_raise_one_text(algorithm):
    """The first text published in the group's store is every rank's (shared memory's
    check compares pairs; before, rank 2 could raise its pair's text, ranks 0 and 1
    theirs)."""
    for _ in range(2):  # the pairs race: more than one try
        res = RankPool(3, pg_timeout_s=30).outcomes(three_way, algorithm, timeout=60)
        got = [res[r].result for r in range(3)]
        assert all(g and g["type"] == "CollectiveMismatchError" for g in got), [res[r].error[-800:] for r in range(3)]
        assert len({g["msg"] for g in got}) == 1, [g["msg"] for g in got]


def cuda_waits(rank, p):
    """What the check of a call on a GPU, whose group moves GPU memory itself, asks of
    shared memory (record_poster's wait_all), against a CPU call's."""
    from commlab.core import groups
    from commlab.core.reduction import Op
    from commlab.transports import p2p, shm

    seen = []
    real = shm.record_poster
    shm.record_poster = lambda *a: seen.append(a[-1]) or real(*a)
    p2p.moves_cuda = lambda group: True  # NCCL's transfers, which no closed connection takes back
    link = p2p.P2P(groups.resolve(dist.new_group()), "ring")
    for cuda in (False, True):
        link.checker("all_reduce", torch.float32, Op.SUM, "ring", lambda: ("ring",), cuda=cuda)
    return seen


def test_a_call_whose_transfers_nccl_posts_waits_for_every_record():
    """A rank that went on to NCCL's transfers before a later rank found a difference
    could not be stopped by closing gloo's connection: such calls wait for every record."""
    res = RankPool(2, pg_timeout_s=30).outcomes(cuda_waits, timeout=60)
    assert [res[r].result for r in range(2)] == [[False, True]] * 2, [res[r].error[-1500:] for r in range(2)]
