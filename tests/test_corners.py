"""The corners where a call gave wrong data or hung without a word, each now the same
CollectiveMismatchError on every rank within 2 s, or a working call:

- the caller's AVG against another rank's SUM on a transport that compares records (it
  reached shared memory as SUM, so the records matched: rank 0 returned 1.5, rank 1 3.0);
- an empty tensor against a non-empty one where the transport compares records (the
  empty rank returned at once or agreed elsewhere, its peer waited in shared memory);
- `auto` after a warm-up, AVG against SUM (the AVG plan gathered afresh while its peer
  waited in shared memory with its cached plan: both hung);
- a CommState for a group only its members build (a non-member waited for in the
  store while it sat in DDP's constructor: both hung), and states built in crossed
  orders.

Every case runs on a fresh group in one pool, so the file costs one spawn."""
import os
import re
import time

import pytest
import torch
import torch.distributed as dist

import commlab
from commlab.measure.pools import RankPool

FAMILIES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
N = 4096


def _call(family, n, p, group, algorithm, op=dist.ReduceOp.SUM):
    """One call of `family` with n elements per rank (the API's shapes); the result's first value."""
    if family == "all_reduce":
        t = torch.full((n,), float(dist.get_rank() + 1))
        commlab.all_reduce(t, op=op, group=group, algorithm=algorithm)
        return t[:1].tolist()
    if family == "all_gather":
        out = torch.empty(n * p)
        commlab.all_gather(out, torch.ones(n), group=group, algorithm=algorithm)
        return out[:1].tolist()
    if family == "reduce_scatter":
        out = torch.empty(n)
        commlab.reduce_scatter(out, torch.full((n * p,), float(dist.get_rank() + 1)), op=op, group=group,
                               algorithm=algorithm)
        return out[:1].tolist()
    if family == "broadcast":
        t = torch.ones(n)
        commlab.broadcast(t, 0, group=group, algorithm=algorithm)
        return t[:1].tolist()
    out = torch.empty(n * p)
    commlab.all_to_all(out, torch.ones(n * p), group=group, algorithm=algorithm)
    return out[:1].tolist()


def _outcome(fn):
    t0 = time.monotonic()
    try:
        value = fn()
    except Exception as e:  # noqa: BLE001 - the test reads it
        return {"type": type(e).__name__, "msg": str(e), "s": time.monotonic() - t0}
    return {"type": None, "value": value, "s": time.monotonic() - t0}


def corners(rank, p, cases):
    """Each case on a fresh group, after one healthy call (later calls are checked too)."""
    out = []
    for kind, family, algorithm in cases:
        group = dist.new_group(backend="commlab" if algorithm == "backend" else None)
        if algorithm == "backend":
            out.append(_outcome(lambda: _backend_avg_vs_sum(family, p, group)))
            continue
        _call(family, 64, p, group, algorithm)
        if kind == "avg":
            op = dist.ReduceOp.AVG if rank == 0 else dist.ReduceOp.SUM
            out.append(_outcome(lambda: _call(family, N, p, group, algorithm, op)))
        else:
            out.append(_outcome(lambda: _call(family, 0 if rank == 0 else N, p, group, algorithm)))
    return out


def _backend_avg_vs_sum(family, p, group):
    op = dist.ReduceOp.AVG if dist.get_rank() == 0 else dist.ReduceOp.SUM
    if family == "all_reduce":
        dist.all_reduce(torch.ones(64), group=group)
        t = torch.full((N,), float(dist.get_rank() + 1))
        dist.all_reduce(t, op=op, group=group)
        return t[:1].tolist()
    dist.reduce_scatter_tensor(torch.empty(64), torch.ones(64 * p), group=group)
    out = torch.empty(N)
    dist.reduce_scatter_tensor(out, torch.full((N * p,), float(dist.get_rank() + 1)), op=op, group=group)
    return out[:1].tolist()


AVG_CASES = [("avg", "all_reduce", a) for a in ("shm", "shm_ps", "hier", "auto")] + \
    [("avg", "reduce_scatter", a) for a in ("shm", "hier", "auto")] + \
    [("avg", f, "backend") for f in ("all_reduce", "reduce_scatter")]
EMPTY_CASES = [("empty", f, a) for f in FAMILIES for a in ("shm", "auto")] + \
    [("empty", "all_reduce", a) for a in ("shm_ps", "hier", "ring")] + \
    [("empty", f, a) for f, a in (("all_gather", "ring"), ("reduce_scatter", "ring"), ("broadcast", "binomial"),
                                  ("all_to_all", "pairwise"))]


def _run(pool: RankPool, fn, *args, timeout: float = 60):
    try:
        return pool.run(fn, *args, timeout=timeout)
    finally:
        pool.close()


def _segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("commlab-")}


def test_every_corner_is_the_same_mismatch_on_every_rank_within_two_seconds():
    before = _segments()
    cases = AVG_CASES + EMPTY_CASES
    res = RankPool(2, pg_timeout_s=30).outcomes(corners, cases, timeout=120)
    for r in range(2):
        assert res[r].status == "ok", f"rank {r}: {res[r].status}: {res[r].error[-3000:]}"
    for i, case in enumerate(cases):
        got = [res[r].result[i] for r in range(2)]
        assert all(g["type"] == "CollectiveMismatchError" for g in got), (case, got)  # no wrong data, no other error
        assert all(g["s"] < 2.0 for g in got), (case, got)
        if case[0] == "avg":
            assert all("AVG" in g["msg"] and "SUM" in g["msg"] for g in got), (case, got)
        else:  # the empty side named as such
            assert all(re.search(r"\b0 (bytes|elements|float32)", g["msg"]) for g in got), (case, got)
        assert got[0]["msg"] == got[1]["msg"], (case, got)  # the same text everywhere
    assert _segments() <= before  # every group's segments unlinked


def both_empty(rank, p):
    out = []
    for family in FAMILIES:
        group = dist.new_group()
        out.append(_call(family, 0, p, group, "shm") == [] and _call(family, 8, p, group, "shm") != [])
    return out


def test_two_empty_calls_still_match_and_return():
    """The empty call's record is compared, not refused: ranks that agree go on."""
    assert _run(RankPool(2), both_empty) == [[True] * len(FAMILIES)] * 2


def states_of_members_only(rank, p):
    """The issue's case: rank 0 alone builds a state for its one-rank group, then both
    build DDP and a world state and train."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from commlab.training import hooks

    solo = dist.new_group([0])
    if rank == 0:
        hooks.CommState("ring", group=solo).close()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 2))
    state = hooks.CommState("ring")
    hooks.register(model, state)
    for _ in range(2):
        model(torch.ones(4, 8) * (rank + 1)).sum().backward()
    grad = model.module.weight.grad.clone()
    state.close()
    later = dist.new_group()  # groups made by every rank afterwards are named alike everywhere
    t = torch.ones(4)
    dist.all_reduce(t, group=later)
    return grad.tolist(), t.tolist()


def test_only_the_members_of_a_states_group_build_it():
    res = _run(RankPool(2, pg_timeout_s=30), states_of_members_only)
    assert res[0] == res[1] and res[0][1] == [2.0] * 4


def crossed_states(rank, p):
    from commlab.training import hooks

    t0 = time.monotonic()
    try:
        if rank == 0:
            hooks.CommState("ring", group=[0, 1])
            hooks.CommState("ring")
        elif rank == 1:
            hooks.CommState("ring")
            hooks.CommState("ring", group=[0, 1])
        else:
            hooks.CommState("ring")
    except commlab.CollectiveMismatchError as e:
        return str(e), time.monotonic() - t0
    return "NOT RAISED", time.monotonic() - t0


@pytest.mark.slow
def test_states_built_in_crossed_orders_raise_at_once_on_every_rank():
    """Rank 0 waits for rank 1 in the state of [0, 1] while rank 1 waits for rank 0 in
    the world's: neither can go on; rank 2, waiting in the world's, learns it too."""
    res = _run(RankPool(3, pg_timeout_s=30, env={"COMMLAB_SETUP_TIMEOUT": "60"}), crossed_states)
    texts = {msg for msg, _ in res}
    assert len(texts) == 1, texts
    msg = texts.pop()
    assert "rank 0 waits for rank 1 in a CommState for ranks [0, 1]" in msg, msg
    assert "rank 1 waits for rank 0 in a CommState for ranks [0, 1, 2]" in msg, msg
    assert all(s < 2.0 for _, s in res), res
