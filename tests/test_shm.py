"""Shared-memory specifics beyond the registry sweep: pieces, concurrent groups,
threads, leaks, /dev/shm hygiene, refusals and dead peers."""
import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist
from ranks import RankPool, status_payload

import commlab
from commlab.transports import shm

SHM_ALGORITHMS = ["shm", "shm_ps"]


def _leftovers():
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith("commlab-"))


def big_tensors(rank, p, algorithm):
    out = []
    # 1 MiB against the tests' 16 KiB buffers: 64 pieces, alternating parity.
    for dtype, n in ((torch.float32, 1 << 18), (torch.bfloat16, 100_003), (torch.int64, 70_001)):
        x = (torch.arange(n, dtype=torch.int64) % 13 + rank).to(dtype)
        commlab.all_reduce(x, algorithm=algorithm)
        want = (p * (torch.arange(n, dtype=torch.int64) % 13) + sum(range(p))).to(dtype)
        if not torch.equal(x, want):
            out.append(f"{dtype} n={n}: {(x != want).sum()} wrong")
    out.append(("leftovers", _leftovers()))
    return out


@pytest.mark.parametrize("algorithm", SHM_ALGORITHMS)
def test_tensors_larger_than_the_buffers(ranks, algorithm):
    for res in ranks.run(4, big_tensors, algorithm):
        assert res[-1] == ("leftovers", []), res[-1]
        assert not res[:-1], res


def fast_and_slow(rank, p, algorithm, env):
    """After a first call, calls like it skip the algorithm's run (one transport call);
    anything else takes the long way and is still right."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    from commlab.api import all_reduce as api
    from commlab.api import family
    alg = commlab.get_algorithm(algorithm)
    runs = []
    real_run = type(alg).run
    alg.run = lambda buf, op, ctx: (runs.append(buf.numel()), real_run(alg, buf, op, ctx))
    g = dist.new_group(list(range(p)))  # its own lane and plans, whatever earlier tests left on the world's
    try:
        x = torch.full((1000,), float(rank + 1))
        commlab.all_reduce(x, group=g, algorithm=algorithm)  # plans the call (and sets shm up)
        out = {"first": runs[:], "fast": family.fast_plan(("all_reduce", algorithm, id(dist.ReduceOp.SUM), id(g))) is not None}
        want = float(p * (p + 1) // 2)
        ok = [torch.equal(x, torch.full_like(x, want))]
        # Another dtype takes the fast path over; the first call like x's takes it back.
        for t in (torch.full((1000,), float(rank + 1), dtype=torch.float64), x.fill_(rank + 1)):
            commlab.all_reduce(t, group=g, algorithm=algorithm)
            ok.append(torch.equal(t, torch.full_like(t, want)))
        del runs[:]
        for k in range(3):
            x.fill_(rank + 1 + k)
            commlab.all_reduce(x, group=g, algorithm=algorithm)
            ok.append(torch.equal(x, torch.full_like(x, want + p * k)))
        out["like calls"] = runs[:]
        del runs[:]
        others = [torch.full((40, 30), float(rank + 1)).t(),  # not contiguous
                  torch.full((1000,), float(rank + 1), dtype=torch.float64),  # another dtype
                  torch.zeros(0)]  # empty
        for y in others:
            commlab.all_reduce(y, group=g, algorithm=algorithm)
            ok.append(torch.equal(y, torch.full_like(y, want)))
        out["other calls"] = runs[:]
        out["ok"] = ok
        return out
    finally:
        dist.barrier()
        dist.destroy_process_group(g)
        del alg.run
        api._plans.clear()  # plans made under this env would outlive it (their fast paths too)
        for k, v in saved.items():  # the pool's ranks live on into other tests
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


@pytest.mark.parametrize("algorithm", SHM_ALGORITHMS)
def test_fast_path_serves_like_calls_and_steps_aside_for_others(ranks, algorithm):
    for got in ranks.run(3, fast_and_slow, algorithm, {}):
        assert got["first"] == [1000] and got["fast"], got
        assert got["like calls"] == [], got  # no Python layer below the API ran
        # The empty call goes the long way too, down to the transport, which checks its record.
        assert got["other calls"] == [1200, 1000, 0], got
        assert all(got["ok"]), got


def test_checked_calls_never_take_the_fast_path(ranks):
    for got in ranks.run(2, fast_and_slow, "shm", {"COMMLAB_CHECK": "1"}):
        assert not got["fast"] and got["like calls"] == [1000] * 3 and all(got["ok"]), got


def two_groups(rank, p):
    other = dist.new_group(list(range(p)))  # same ranks, a second communicator
    pair = dist.new_group([0, 1])
    out = []
    xs = [torch.full((5000,), float(rank + k)) for k in range(6)]
    works = []
    for k, x in enumerate(xs):
        g = None if k % 2 == 0 else other
        works.append(commlab.all_reduce(x, group=g, algorithm="shm", async_op=True))
    if rank < 2:
        y = torch.full((777,), float(rank + 1))
        commlab.all_reduce(y, group=pair, algorithm="shm")
        if not torch.equal(y, torch.full((777,), 3.0)):
            out.append("pair group wrong")
    for k, (w, x) in enumerate(zip(works, xs)):
        w.wait()
        want = float(sum(r + k for r in range(p)))
        if not torch.equal(x, torch.full_like(x, want)):
            out.append(f"tensor {k} wrong: {x[0]} vs {want}")
    for g in (other, pair):
        if g != dist.GroupMember.NON_GROUP_MEMBER:
            shm.release(g)
            dist.destroy_process_group(g)
    return out


def test_two_groups_at_once(ranks):
    for res in ranks.run(4, two_groups):
        assert not res, res


def from_thread(rank, p, algorithm):
    result = {}

    def body():
        try:
            x = torch.full((3000,), float(rank))
            commlab.all_reduce(x, algorithm=algorithm)
            result["x"] = x[0].item()
        except BaseException as e:  # noqa: BLE001 - reported to the test
            result["error"] = repr(e)

    t = threading.Thread(target=body)
    t.start()
    t.join(60)
    return result


@pytest.mark.parametrize("algorithm", SHM_ALGORITHMS)
def test_called_from_another_thread(ranks, algorithm):
    for res in ranks.run(3, from_thread, algorithm):
        assert res == {"x": 3.0}, res


def split_hosts(rank, p):
    # Pretend ranks 0,1 and 2,3 live on two hosts: setup must refuse on every rank.
    real = shm.host_id
    shm.host_id = lambda: f"node{rank // 2}/boot/mnt:1/net:{rank // 2}"
    g = dist.new_group(list(range(p)))
    try:
        commlab.all_reduce(torch.ones(10), group=g, algorithm="shm")
    except commlab.UnsupportedError as e:
        msg = str(e)
    else:
        msg = "NOT RAISED"
    finally:
        shm.host_id = real  # the rank pool lives on into other tests
    x = torch.ones(10)
    commlab.all_reduce(x, group=g, algorithm="ring")  # the group itself is fine
    dist.destroy_process_group(g)
    return msg, x.tolist()


def test_refuses_a_group_spanning_hosts(ranks):
    res = ranks.run(4, split_hosts)
    assert all(r == res[0] for r in res), "ranks disagree"
    msg, x = res[0]
    assert "more than one host" in msg and "node0" in msg and "node1" in msg, msg
    assert x == [4.0] * 10


def refuses_gpu_tensors(rank, p):
    try:
        commlab.all_reduce(torch.ones(3, device="meta"), algorithm="shm")
    except commlab.UnsupportedError as e:
        return str(e)
    return "NOT RAISED"


def test_refuses_non_cpu_tensors(ranks):
    res = ranks.run(2, refuses_gpu_tensors)
    assert res[0] == res[1] and "not supported" in res[0]


def dies_mid_run(rank, p, algorithm, victim):
    x = torch.ones(1000)
    commlab.all_reduce(x, algorithm=algorithm)  # set up and mapped by everyone
    if rank == victim:
        os._exit(17)
    t0 = time.monotonic()
    try:
        commlab.all_reduce(x, algorithm=algorithm)
    except commlab.CommlabError as e:
        return {"error": str(e), "type": type(e).__name__, "seconds": time.monotonic() - t0,
                "leftovers": _leftovers()}
    return {"error": None}


@pytest.mark.parametrize("algorithm", SHM_ALGORITHMS)
@pytest.mark.parametrize("victim", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_dead_peer_is_named_not_waited_for(ranks, algorithm, victim):
    pool = ranks.get(3)
    res = pool.outcomes(dies_mid_run, algorithm, victim, timeout=60)
    assert res[victim].status == "missing"
    survivors = [r for r in range(3) if r != victim]
    named = 0
    for r in survivors:
        status, payload = status_payload(res[r])
        assert status == "ok", payload
        # Every survivor fails, none returns: a shm_ps worker that only waits for rank 0
        # learns of a dead worker through rank 0's abort mark.
        assert payload["error"] is not None, (r, payload)
        assert payload["type"] == "PeerError"
        assert f"rank {victim}" in payload["error"] and "dead" in payload["error"], payload
        named += 1
        assert payload["seconds"] < 10, payload  # noticed by liveness checks, not the 30 s timeout
        assert payload["leftovers"] == []
    assert named == len(survivors)
    assert _leftovers() == []


def spin_choice(rank, p):
    g = dist.new_group(list(range(p)))
    commlab.all_reduce(torch.ones(10), group=g, algorithm="shm")
    comm = shm._entries.get(g).comm
    spin, yield_us = comm.spin, comm.yield_us
    dist.destroy_process_group(g)
    return spin, yield_us, len(os.sched_getaffinity(0))


@pytest.mark.parametrize("world", [2, 4])
def test_waiters_spin_only_with_a_core_each_and_yield_in_one_sched_group(ranks, world):
    # The pool's ranks are in the test's session: one scheduling group.
    for spin, yield_us, cores in ranks.run(world, spin_choice):
        assert spin == (shm.SPIN if world <= cores else 0)
        assert yield_us == shm.YIELD_US > 0


def own_session_spin_choice(rank, p):
    os.setsid()  # torchrun's and MPICH's way: a session, so an autogroup, per rank
    return spin_choice(rank, p)


@pytest.mark.slow
def test_ranks_in_sched_groups_of_their_own_sleep_at_once_when_they_share_cores():
    autogroup = open("/proc/sys/kernel/sched_autogroup_enabled").read().strip() == "1" \
        if os.path.exists("/proc/sys/kernel/sched_autogroup_enabled") else False
    if not autogroup:
        pytest.skip("autogroup is off: sessions do not make scheduling groups here")
    pool = RankPool(4)
    try:
        res = pool.run(own_session_spin_choice, timeout=120)
    finally:
        pool.close()
    for spin, yield_us, cores in res:
        assert (spin, yield_us) == ((shm.SPIN, shm.YIELD_US) if 4 <= cores else (0, 0)), (spin, yield_us, cores)


def _family_case(collective, rank, p, n, dtype=torch.float32):
    """(call(g, **kw), the result it must leave) for one shm call of `collective`."""
    if collective == "broadcast":
        t = torch.full((n,), float(rank + 1), dtype=dtype)
        return (lambda g, t=t, **kw: commlab.broadcast(t, src=0, group=g, algorithm="shm", **kw)), \
            (lambda t=t: torch.equal(t, torch.ones(n, dtype=dtype)))
    if collective == "all_gather":
        inp, out = torch.full((n,), float(rank + 1), dtype=dtype), torch.empty(p * n, dtype=dtype)
        want = torch.arange(1, p + 1, dtype=dtype).repeat_interleave(n)
        return (lambda g, out=out, **kw: commlab.all_gather(out, inp, group=g, algorithm="shm", **kw)), \
            (lambda: torch.equal(out, want))
    if collective == "reduce_scatter":
        inp, out = torch.full((p * n,), float(rank + 1), dtype=dtype), torch.empty(n, dtype=dtype)
        return (lambda g, out=out, **kw: commlab.reduce_scatter(out, inp, group=g, algorithm="shm", **kw)), \
            (lambda: torch.equal(out, torch.full((n,), float(p * (p + 1) // 2), dtype=dtype)))
    inp = (torch.arange(p * n) + 1000 * rank).to(dtype)
    out = torch.empty(p * n, dtype=dtype)
    want = torch.cat([(torch.arange(n) + rank * n + 1000 * j).to(dtype) for j in range(p)])
    return (lambda g, out=out, **kw: commlab.all_to_all(out, inp, group=g, algorithm="shm", **kw)), \
        (lambda: torch.equal(out, want))


def family_fast_and_slow(rank, p, collective):
    """The other families' fast path: after a first call, calls like it run in one
    transport call; anything else takes the long way, pairs with peers on the fast one,
    and a rank refusing its own arguments there fails its peers waiting in the fast one."""
    from commlab.algorithms import registry
    from commlab.api import family
    alg = registry(collective).get("shm")
    runs = []
    real_run = type(alg).run
    alg.run = lambda *a: (runs.append(1), real_run(alg, *a))
    g = dist.new_group(list(range(p)))
    out = {"ok": []}
    try:
        call, right = _family_case(collective, rank, p, 1000)
        call(g)
        out["first"] = len(runs)
        out["fast"] = any(key[0] == collective and key[-1] == id(g) for key in family._fast)
        out["ok"].append(right())
        del runs[:]
        for _ in range(3):
            call, right = _family_case(collective, rank, p, 1000)
            call(g)
            out["ok"].append(right())
        out["like calls"] = len(runs)
        # Another dtype takes the fast path over; the first call like the first takes it back.
        for dtype in (torch.float64, torch.float32, torch.float32):
            call, right = _family_case(collective, rank, p, 1000, dtype)
            call(g)
            out["ok"].append(right())
        del runs[:]
        # A rank whose tensors the fast path does not take (a Parameter, async) pairs with
        # peers that took it.
        call, right = _family_case(collective, rank, p, 1000)
        if rank == 0:
            call(g, async_op=True).wait()
        else:
            call(g)
        out["ok"].append(right())
        out["mixed runs"] = len(runs)
        # The last rank refuses its own arguments on the long way; its peers wait in the fast one.
        call, right = _family_case(collective, rank, p, 1000 if rank < p - 1 else 999)
        start = time.monotonic()
        try:
            if collective == "broadcast" and rank == p - 1:
                commlab.broadcast(torch.zeros(1000), group_src=p, group=g, algorithm="shm")
            elif collective == "all_to_all" and rank == p - 1:
                commlab.all_to_all(torch.empty(p * 1000 + 1), torch.zeros(p * 1000), group=g, algorithm="shm")
            elif collective in ("all_gather", "reduce_scatter") and rank == p - 1:
                big, small = torch.zeros(p * 1000 + 1), torch.zeros(1000)
                args = (big, small) if collective == "all_gather" else (small, big)
                getattr(commlab, collective)(*args, group=g, algorithm="shm")
            else:
                _family_case(collective, rank, p, 1000)[0](g)
            out["refusal"] = "returned"
        except Exception as e:  # noqa: BLE001 - the type and text are what the test checks
            out["refusal"] = (type(e).__name__, str(e)[:300], time.monotonic() - start)
        return out
    finally:
        del alg.run
        dist.destroy_process_group(g)


@pytest.mark.parametrize("collective", ["broadcast", "all_gather", "reduce_scatter", "all_to_all"])
def test_family_fast_path_serves_like_calls_and_steps_aside_for_others(ranks, collective):
    got = ranks.run(3, family_fast_and_slow, collective)
    for rank, res in enumerate(got):
        assert res["first"] == 1 and res["fast"], res
        assert res["like calls"] == 0, res  # no Python layer below the API ran
        assert all(res["ok"]), res
        assert res["mixed runs"] == (1 if rank == 0 else 0), res
        kind, text, took = res["refusal"]
        assert kind == ("UnsupportedError" if rank == 2 else "PeerError"), res
        assert "rank 2" in text or rank == 2, res
        assert took < 5, res


# Sizes that end mid-piece, odd element counts, every element size, one past a buffer.
PIECE_CASES = ((torch.float32, 1), (torch.float32, 5000), (torch.bfloat16, 100_003), (torch.int64, 70_001),
               (torch.uint8, (1 << 20) + 3))


def _pattern(n: int, dtype, who: int) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.int64) % 251 + 7 * who).to(dtype)


def single_copy_broadcasts(rank, p, lo, hi, piece=""):
    """Broadcasts on a group whose shm takes one copy for [lo, hi) bytes and pieces of
    `piece` bytes otherwise: every size and root right."""
    saved = shm.SINGLE_COPY_MIN, shm.SINGLE_COPY_MAX
    shm.SINGLE_COPY_MIN, shm.SINGLE_COPY_MAX = lo, hi
    os.environ["COMMLAB_SHM_PIECE"] = piece
    g = dist.new_group(list(range(p)))
    try:
        wrong = []
        for dtype, n in PIECE_CASES:
            for root in range(p):
                x = _pattern(n, dtype, rank)
                commlab.broadcast(x, src=root, group=g, algorithm="shm")
                want = _pattern(n, dtype, root)
                if not torch.equal(x, want):
                    wrong.append((str(dtype), n, root))
        comm = shm.state_of(commlab.core.groups.resolve(g)).comm
        return {"wrong": wrong, "min": comm.single_copy_min, "max": comm.single_copy_max,
                "probe": comm.probe_single_copy(), "piece": comm.piece_bytes}
    finally:
        shm.SINGLE_COPY_MIN, shm.SINGLE_COPY_MAX = saved
        os.environ.pop("COMMLAB_SHM_PIECE")
        dist.barrier()
        dist.destroy_process_group(g)


@pytest.mark.parametrize("lo,hi,piece", [(1024, 0, ""), (1024, 300_000, "4096"), (-1, 0, "4100"), (-1, 0, "")])
def test_single_copy_broadcast_is_right_at_every_size_and_root(ranks, lo, hi, piece):
    for res in ranks.run(3, single_copy_broadcasts, lo, hi, piece):
        assert res["wrong"] == [], res
        assert res["probe"], res  # this machine lets ranks read each other: the path ran
        assert (res["min"], res["max"]) == (lo, hi), res
        # 3 ranks on 2 cores keep whole buffers unless told (4100: not a multiple of 8 bytes)
        assert res["piece"] == (int(piece) if piece else 0), res


def single_copy_all_to_alls(rank, p, lo):
    """All-to-alls on a group whose shm reads blocks of at least `lo` bytes out of its
    peers' inputs (-1: never): every dtype right, with no block, small uneven ones, one
    large block only its two ranks know of before the matrix of counts, and blocks of
    several pieces; splits that disagree at that size fail every rank alike."""
    saved = shm.ALLTOALL_SINGLE_COPY_MIN
    shm.ALLTOALL_SINGLE_COPY_MIN = lo
    g = dist.new_group(list(range(p)))
    try:
        wrong = []
        for dtype in (torch.float32, torch.bfloat16, torch.uint8, torch.int64):
            for case, rows in (
                    ("none", [[0] * p for _ in range(p)]),
                    ("small", [[(j * 7 + q * 3) % 5 for q in range(p)] for j in range(p)]),
                    ("one large", [[2000 if (j, q) == (0, p - 1) else (j + q) % 3 for q in range(p)]
                                   for j in range(p)]),
                    ("pieces", [[(1 << 18) * ((j + q) % 3) + 5 for q in range(p)] for j in range(p)])):
                inp = torch.cat([_pattern(rows[rank][q], dtype, rank * p + q) for q in range(p)])
                want = torch.cat([_pattern(rows[j][rank], dtype, j * p + rank) for j in range(p)])
                out = torch.full_like(want, 99)
                commlab.all_to_all(out, inp, [rows[j][rank] for j in range(p)], rows[rank], group=g,
                                   algorithm="shm")
                if not torch.equal(out, want) or not torch.equal(
                        inp, torch.cat([_pattern(rows[rank][q], dtype, rank * p + q) for q in range(p)])):
                    wrong.append((str(dtype), case))
        comm = shm.state_of(commlab.core.groups.resolve(g)).comm
        got, one_copy = comm.alltoall_single_copy_min, comm.single_copy_calls
        # Rank 1 expects 10 rows fewer from rank 0 than rank 0 sends it.
        recv = [5000 - (10 if (rank, j) == (1, 0) else 0) for j in range(p)]
        try:
            commlab.all_to_all(torch.empty(sum(recv)), torch.zeros(5000 * p), recv, [5000] * p, group=g,
                               algorithm="shm")
            error = None
        except commlab.CommlabError as e:
            error = (type(e).__name__, "rank 0 sends 5000 elements to rank 1, which expects 4990" in str(e))
        return {"wrong": wrong, "min": got, "one_copy": one_copy, "error": error}
    finally:
        shm.ALLTOALL_SINGLE_COPY_MIN = saved
        dist.barrier()
        dist.destroy_process_group(g)


@pytest.mark.parametrize("lo", [1024, 0, -1])
def test_single_copy_all_to_all_is_right_and_agreed(ranks, lo):
    for res in ranks.run(3, single_copy_all_to_alls, lo):
        assert res["wrong"] == [], res
        assert res["min"] == lo, res  # this machine lets ranks read each other: the setting holds
        # The calls that went in one copy: all 16 at 0 (those that move no byte too), the 8
        # with a block of at least 1 KiB at 1024, none at -1.
        assert res["one_copy"] == {0: 16, 1024: 8, -1: 0}[lo], res
        assert res["error"] == ("CollectiveMismatchError", True), res


def one_copy_bounds_that_differ(rank, p):
    """Rank 0's communicator told to read its peers' memory from 1 KiB blocks, its peers'
    never (set on the communicator, past setup's agreement): the call is the same
    mismatch on every rank, naming the bound, not one rank reading a buffer its peer
    has already handed back."""
    g = dist.new_group(list(range(p)))
    try:
        x = torch.full((p * 4096,), float(rank))
        out = torch.empty_like(x)
        commlab.all_to_all(out, x, group=g, algorithm="shm")
        comm = shm.state_of(commlab.core.groups.resolve(g)).comm
        if comm.probe_single_copy() and rank == 0:
            comm.alltoall_single_copy_min = 1024
        try:
            commlab.all_to_all(out, x, group=g, algorithm="shm")
            return None
        except commlab.CommlabError as e:
            return type(e).__name__, "one copy from 1024 bytes" in str(e)
    finally:
        dist.destroy_process_group(g)


def test_one_copy_bounds_that_differ_are_a_mismatch_on_every_rank(ranks):
    assert ranks.run(3, one_copy_bounds_that_differ) == [("CollectiveMismatchError", True)] * 3


def all_gathers_in_pieces(rank, p, piece):
    """All-gathers on a group whose shm moves `piece` bytes at a time: every size, dtype
    and slice right, including sizes that end mid-piece and pieces not a multiple of the
    element size."""
    os.environ["COMMLAB_SHM_PIECE"] = piece
    g = dist.new_group(list(range(p)))
    try:
        wrong = []
        for dtype, n in PIECE_CASES:
            out = torch.empty(n * p, dtype=dtype)
            commlab.all_gather(out, _pattern(n, dtype, rank), group=g, algorithm="shm")
            want = torch.cat([_pattern(n, dtype, r) for r in range(p)])
            if not torch.equal(out, want):
                wrong.append((str(dtype), n))
        return {"wrong": wrong, "piece": shm.state_of(commlab.core.groups.resolve(g)).comm.piece_bytes}
    finally:
        os.environ.pop("COMMLAB_SHM_PIECE")
        dist.barrier()
        dist.destroy_process_group(g)


@pytest.mark.parametrize("p,piece,want", [(2, "", shm.PIECE), (2, "4100", 4100), (3, "4096", 4096), (3, "", 0)])
def test_all_gather_in_pieces_is_right_at_every_size(ranks, p, piece, want):
    """Pieces of a buffer's part where every rank has a core (2 ranks here), whole
    buffers where ranks share cores (3), or as told."""
    for res in ranks.run(p, all_gathers_in_pieces, piece):
        assert res["wrong"] == [], res
        assert res["piece"] == want, res


def root_dies_before_a_reader_reads(rank, p):
    """Rank 2's helper thread stops rank 1 (waiting for the root's data), kills the root
    once it has published (it then waits for rank 1 to finish reading), and resumes rank 1:
    rank 1's read of a dead process fails naming the root, fast."""
    saved = shm.SINGLE_COPY_MIN, shm.SINGLE_COPY_MAX
    shm.SINGLE_COPY_MIN, shm.SINGLE_COPY_MAX = 1024, 0
    pids = [None] * p
    dist.all_gather_object(pids, os.getpid())
    x = torch.full((1 << 20,), float(rank))
    commlab.broadcast(x, src=0, algorithm="shm")  # set up: one copy from 1 KiB
    dist.barrier()
    shm.SINGLE_COPY_MIN, shm.SINGLE_COPY_MAX = saved
    if rank == 2:
        def helper():
            time.sleep(0.3)
            os.kill(pids[1], signal.SIGSTOP)
            time.sleep(0.5)
            os.kill(pids[0], signal.SIGKILL)
            time.sleep(0.2)
            os.kill(pids[1], signal.SIGCONT)
        threading.Thread(target=helper, daemon=True).start()
    if rank == 0:
        time.sleep(0.5)  # rank 1 is stopped, having announced itself
    x.fill_(rank + 10)
    t0 = time.monotonic()
    try:
        commlab.broadcast(x, src=0, algorithm="shm")
        return {"error": None, "right": bool(torch.equal(x, torch.full_like(x, 10.0)))}
    except commlab.CommlabError as e:
        return {"error": type(e).__name__, "msg": str(e), "s": time.monotonic() - t0}


def _three_fresh_ranks(fn):
    """fn's outcome on each of three ranks of a pool of their own (one of them is killed)."""
    pool = RankPool(3)
    try:
        return pool.outcomes(fn, timeout=60)
    finally:
        pool.close()


def test_a_root_that_dies_before_a_single_copy_read_is_named():
    res = _three_fresh_ranks(root_dies_before_a_reader_reads)
    assert res[0].status == "missing"
    s1, r1 = status_payload(res[1])
    s2, r2 = status_payload(res[2])
    assert s1 == "ok" and r1["error"] == "PeerError" and "rank 0" in r1["msg"] and r1["s"] < 3, r1
    # Rank 2 read the root's data before the root died: its call is complete and right.
    assert s2 == "ok" and r2 == {"error": None, "right": True}, r2


def all_to_all_reads_a_dead_rank(rank, p):
    """One-copy all-to-all: rank 0 enters the call first, publishes its counts and its
    input's address, and is killed while it waits for its peers; they enter later, find
    its record in place and read its process's memory: that read fails naming rank 0,
    fast, on both."""
    saved = shm.ALLTOALL_SINGLE_COPY_MIN
    shm.ALLTOALL_SINGLE_COPY_MIN = 1024
    try:
        x = torch.full((p * 4096,), float(rank))
        out = torch.empty_like(x)
        commlab.all_to_all(out, x, algorithm="shm")  # set up: one copy from 1 KiB blocks
        dist.barrier()
    finally:
        shm.ALLTOALL_SINGLE_COPY_MIN = saved
    if rank == 0:
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGKILL)).start()
    else:
        time.sleep(1.0)
    t0 = time.monotonic()
    try:
        commlab.all_to_all(out, x, algorithm="shm")
        return {"error": None}
    except commlab.CommlabError as e:
        return {"error": type(e).__name__, "msg": str(e), "s": time.monotonic() - t0}


@pytest.mark.slow  # the broadcast's test above keeps the one-copy read of a dead peer in the quick tier
def test_a_rank_that_dies_before_its_one_copy_all_to_all_is_read_is_named():
    res = _three_fresh_ranks(all_to_all_reads_a_dead_rank)
    assert res[0].status == "missing"
    for r in (1, 2):
        s, got = status_payload(res[r])
        assert s == "ok" and got["error"] == "PeerError" and "rank 0" in got["msg"] and got["s"] < 3, got
        assert "could not read rank 0's buffer" in got["msg"], got  # the read itself found it dead


def unhashable_src_after_a_planned_call(rank, p):
    """A broadcast with a src the fast path cannot look up (a list) goes the long way and
    is refused there on that rank; its peers, in the fast path, raise naming it."""
    g = dist.new_group(list(range(p)))
    try:
        x = torch.ones(100)
        commlab.broadcast(x, src=0, group=g, algorithm="shm")
        commlab.broadcast(x, src=0, group=g, algorithm="shm")  # planned: the fast path from here
        src = [0] if rank == 1 else 0
        try:
            commlab.broadcast(x, src=src, group=g, algorithm="shm")
            return "returned"
        except Exception as e:  # noqa: BLE001 - the type is what the test checks
            return type(e).__name__
    finally:
        dist.destroy_process_group(g)


def test_an_unhashable_src_is_refused_not_a_type_error(ranks):
    assert ranks.run(3, unhashable_src_after_a_planned_call) == ["PeerError", "UnsupportedError", "PeerError"]
