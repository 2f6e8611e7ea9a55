"""Faults and bad input: mismatched calls, dead peers, destroyed groups, forged or
squatted shared-memory segments. Every failure is an error on every rank, never a hang."""
import os
import secrets
import time

import pytest
import torch
import torch.distributed as dist
from cases import on_fresh_group
from ranks import RankPool, status_payload

import commlab
from commlab.core import ext as _ext

PURE = [a for a in commlab.algorithms.for_device("cpu") if not a.startswith("shm")]


def quick_for(names, quick=("ring", "shm")):
    """Every algorithm in the full suite; the quick tier keeps one per transport."""
    return [n if n in quick else pytest.param(n, marks=pytest.mark.slow) for n in names]


def mismatches(rank, p):
    os.environ["COMMLAB_CHECK"] = "1"
    out = {}
    cases = {
        "numel": lambda g: commlab.all_reduce(torch.ones(10 + rank), group=g),
        "dtype": lambda g: commlab.all_reduce(torch.ones(10, dtype=torch.float32 if rank else torch.float64), group=g),
        "op": lambda g: commlab.all_reduce(torch.ones(10), op=dist.ReduceOp.MAX if rank else dist.ReduceOp.SUM, group=g),
        "algorithm": lambda g: commlab.all_reduce(torch.ones(10), group=g, algorithm="rd" if rank else "ring"),
    }
    for name, call in cases.items():
        g = dist.new_group(list(range(p)))  # a fresh group: its plans are built with checking on
        try:
            call(g)
            out[name] = "NOT RAISED"
        except commlab.CollectiveMismatchError as e:
            out[name] = str(e)
        x = torch.ones(4)
        commlab.all_reduce(x, group=g)  # still usable afterwards: the check sent no data
        out[name + " after"] = x.tolist()
        dist.destroy_process_group(g)
    del os.environ["COMMLAB_CHECK"]
    return out


def test_mismatch_checking_names_every_rank(ranks):
    res = ranks.run(3, mismatches)
    assert all(r == res[0] for r in res), "ranks raised different errors"
    out = res[0]
    assert "numel=10 " in out["numel"] and "numel=12 " in out["numel"]
    assert "dtype=float64" in out["dtype"] and "dtype=float32" in out["dtype"]
    assert "op=SUM" in out["op"] and "op=MAX" in out["op"]
    assert "algorithm=ring" in out["algorithm"] and "algorithm=rd" in out["algorithm"]
    for name in ("numel", "dtype", "op", "algorithm"):
        assert out[name + " after"] == [3.0] * 4


def family_mismatches(rank, p):
    """COMMLAB_CHECK=1 compares every family's calls through the group's own backend,
    even where the transport compares records itself (shm)."""
    os.environ["COMMLAB_CHECK"] = "1"  # read when a plan is made: each call's group is fresh
    try:
        return {
            "broadcast root": on_fresh_group(p, lambda g: commlab.broadcast(
                torch.ones(8), src=rank % 2, group=g, algorithm="shm"))[:2],
            "all_gather numel": on_fresh_group(p, lambda g: commlab.all_gather(
                torch.empty(p * (4 + rank)), torch.ones(4 + rank), group=g, algorithm="shm"))[:2],
            # Rank 1's own output is wrong: its peers, in the comparison's gather, raise it too.
            "refused": on_fresh_group(p, lambda g: commlab.all_gather(
                torch.empty(p * 4 + rank), torch.ones(4), group=g, algorithm="ring")),
        }
    finally:
        del os.environ["COMMLAB_CHECK"]


def test_mismatch_checking_serves_every_family(ranks):
    res = ranks.run(2, family_mismatches, timeout=60)
    assert all(r[k] == res[0][k] for r in res for k in ("broadcast root", "all_gather numel")), res
    (kind, root), (kind2, numel) = res[0]["broadcast root"], res[0]["all_gather numel"]
    assert kind == kind2 == "CollectiveMismatchError", res[0]
    assert "ranks called broadcast differently" in root and "root=0" in root and "root=1" in root, root
    assert "ranks called all_gather differently" in numel and "numel=4 " in numel and "numel=5 " in numel, numel
    for rank, (kind, text, took) in enumerate(r["refused"] for r in res):
        assert kind == "UnsupportedError" and "output holds" in text and took < 5, (rank, kind, text, took)
        assert ("rank 1 refused" in text) == (rank == 0), (rank, text)


def first_calls_differ(rank, p, mine, theirs):
    g = dist.new_group(list(range(p)))  # fresh: the first call sets the group up
    try:
        commlab.all_reduce(torch.ones(64), group=g, algorithm=theirs if rank == 1 else mine)
    except commlab.CollectiveMismatchError as e:
        return "mismatch", str(e)
    except Exception as e:  # noqa: BLE001 - what the test reports
        return type(e).__name__, str(e)[:300]
    finally:
        dist.destroy_process_group(g)
    return "returned", ""


@pytest.mark.parametrize("mine,theirs", [("shm", "ring"), ("auto", "hier"), ("ring", "rd")])
def test_different_algorithms_in_a_groups_first_call_are_a_mismatch(ranks, mine, theirs):
    # shm's set-up gathered rank 1's host id (ring's agreement route) as its facts: a
    # TypeError on the shm ranks, a PeerError on rank 1, before the set-up steps were named.
    got = ranks.run(3, first_calls_differ, mine, theirs)
    assert all(kind == "mismatch" for kind, _ in got), got
    assert len({text for _, text in got}) == 1, got


def shm_mismatch_unchecked(rank, p):
    g = dist.new_group(list(range(p)))
    try:
        commlab.all_reduce(torch.ones(100 + 50 * rank), group=g, algorithm="shm")
    except commlab.CollectiveMismatchError as e:
        return str(e)
    return "NOT RAISED"


def test_shm_refuses_mismatched_sizes_without_checking(ranks):
    for msg in ranks.run(3, shm_mismatch_unchecked):
        assert "mismatch" in msg and "bytes" in msg, msg


def destroyed_group(rank, p):
    g = dist.new_group(list(range(p)))
    # Every rank's gloo connections up before any tears its own down: a rank that
    # destroyed the group at once failed a peer still connecting (1 run in 3 with forked ranks).
    dist.barrier()
    dist.destroy_process_group(g)
    try:
        commlab.all_reduce(torch.ones(3), group=g)
    except commlab.CommlabError as e:
        return type(e).__name__, str(e)
    return "NOT RAISED", ""


def test_destroyed_group_is_refused(ranks):
    res = ranks.run(2, destroyed_group)
    assert res[0] == res[1] and res[0][0] == "CommlabError", res


def peer_dies(rank, p, algorithm, victim):
    x = torch.ones(2000)
    commlab.all_reduce(x, algorithm=algorithm)
    dist.barrier()
    if rank == victim:
        os._exit(9)
    t0 = time.monotonic()
    try:
        for _ in range(3):
            commlab.all_reduce(x, algorithm=algorithm)
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return {"type": type(e).__name__, "commlab": isinstance(e, commlab.CommlabError), "msg": str(e)[:400],
                "seconds": time.monotonic() - t0}
    return {"type": None}


@pytest.mark.parametrize("algorithm", quick_for(PURE))
def test_dead_peer_gives_errors_not_hangs(algorithm):
    pool = RankPool(3, pg_timeout_s=10)
    res = pool.outcomes(peer_dies, algorithm, 1, timeout=60)
    assert res[1].status == "missing"
    for r in (0, 2):
        status, payload = status_payload(res[r])
        assert status == "ok", payload
        # No survivor may return: without rank 1's input no result is right (ps's rank
        # 2 only talks to rank 0, which never sends it one).
        assert payload["type"] is not None, (r, payload)
        assert payload["commlab"], payload
        assert f"[{algorithm}]" in payload["msg"] or f"[{algorithm}->" in payload["msg"], payload  # auto: [auto->shm]
        assert payload["seconds"] < 10 + 5, payload


def test_forged_stale_and_squatted_segments_are_refused():
    C = _ext.require()
    token = secrets.token_hex(16)
    cap = 4096
    size = 4096 + 2 * cap
    own = C.ShmComm(token, 0, 2, cap, 1000, [0, 1])
    path = f"/dev/shm/commlab-{token}-1"
    try:
        # Forged: right name and size, garbage header.
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.ftruncate(fd, size)
        os.close(fd)
        with pytest.raises(RuntimeError, match="bad magic"):
            own.attach()
        os.unlink(path)
        # Stale/foreign: a genuine segment of another group (other token) renamed into place.
        other = secrets.token_hex(16)
        donor = C.ShmComm(other, 1, 2, cap, 1000, [0, 1])
        os.rename(f"/dev/shm/commlab-{other}-1", path)
        with pytest.raises(RuntimeError, match="token mismatch"):
            own.attach()
        os.chmod(path, 0o644)
        with pytest.raises(RuntimeError, match="0600"):
            own.attach()
        os.unlink(path)
        donor.close()
        # Squatted: a name that already exists is never reused (O_EXCL).
        fd = os.open(f"/dev/shm/commlab-{token}-1", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.close(fd)
        with pytest.raises(RuntimeError, match="File exists"):
            C.ShmComm(token, 1, 2, cap, 1000, [0, 1])
    finally:
        if os.path.exists(path):
            os.unlink(path)
        own.close()
    assert not [n for n in os.listdir("/dev/shm") if token in n]
    # Our own segments are created 0600.
    tok2 = secrets.token_hex(16)
    c = C.ShmComm(tok2, 0, 1, cap, 1000, [0])
    mode = os.stat(f"/dev/shm/commlab-{tok2}-0").st_mode & 0o777
    c.close()
    assert mode == 0o600
    assert not os.path.exists(f"/dev/shm/commlab-{tok2}-0")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_another_user_cannot_attach():
    C = _ext.require()
    token = secrets.token_hex(16)
    own = C.ShmComm(token, 0, 2, 4096, 1000, [0, 1])
    try:
        pid = os.fork()
        if pid == 0:  # child: become nobody and try to map rank 0's segment
            code = 3
            try:
                os.setgid(65534)
                os.setuid(65534)
                intruder = C.ShmComm(secrets.token_hex(16), 1, 2, 4096, 1000, [0, 1])
                try:
                    fd = os.open(f"/dev/shm/commlab-{token}-0", os.O_RDWR)
                    os.close(fd)
                    code = 1  # opened: a failure
                except PermissionError:
                    code = 0
                intruder.close()
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.WEXITSTATUS(status) == 0, "another user could open a commlab segment"
    finally:
        own.close()


def _commlab_mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if "/commlab-" in line)


def groups_are_not_kept_alive(rank, p):
    """A destroyed group must die with its last user reference: a group kept alive by
    commlab's caches is torn down during interpreter shutdown instead, where gloo's
    worker threads abort the process (CI saw it)."""
    import gc
    import weakref

    before = _commlab_mappings()
    out = {}
    for name in commlab.algorithms.for_device("cpu"):
        g = dist.new_group(list(range(p)))
        x = torch.ones(1000)
        commlab.all_reduce(x, group=g, algorithm=name)
        commlab.all_reduce(x, group=g, algorithm=name, async_op=True).wait()
        ref = weakref.ref(g)
        dist.destroy_process_group(g)
        del g
        gc.collect()
        out[name] = ("alive" if ref() is not None else "freed", x[0].item())
    out["mappings left"] = _commlab_mappings() - before
    return out


def test_destroyed_groups_are_released(ranks):
    for res in ranks.run(3, groups_are_not_kept_alive):
        assert res.pop("mappings left") == 0
        assert res == {n: ("freed", 9.0) for n in commlab.algorithms.for_device("cpu")}, res


def p2p_connections_are_not_kept_alive(rank, p):
    """commlab's own gloo context for a group's point-to-point steps goes with the group:
    plans cached after the group's end still hold its link, and a context they kept was torn
    down during interpreter shutdown, where its worker threads abort the process
    ("terminate called without an active exception": once in a documentation example
    that ran every reduce-scatter algorithm and then destroyed its group)."""
    import gc

    from commlab.transports import p2p

    out = {}
    for collective, call in (("all_reduce", lambda g: commlab.all_reduce(torch.ones(10), group=g, algorithm="ring")),
                             ("reduce_scatter", lambda g: commlab.reduce_scatter(
                                 torch.empty(2), torch.ones(2 * p), group=g, algorithm="ring"))):
        g = dist.new_group(list(range(p)))
        call(g)
        link = p2p._links.get(g)
        connected = link.backend is not None
        dist.destroy_process_group(g)
        del g
        gc.collect()
        out[collective] = (connected, "kept" if link.backend is not None else "released")
    return out


def test_a_destroyed_groups_point_to_point_connection_is_released_with_it(ranks):
    for res in ranks.run(3, p2p_connections_are_not_kept_alive):
        assert res == {"all_reduce": (True, "released"), "reduce_scatter": (True, "released")}, res


def killed_mid_collective(rank, p, algorithm, victim, delay_s):
    """The victim SIGKILLs itself from a timer thread while every rank loops over
    collectives large enough that the kill lands inside one (in a transfer, a
    reduction or a wait, wherever the timer fires)."""
    import signal
    import threading

    x = torch.ones(1 << 18)  # 1 MiB: many segments, pieces and steps per call
    commlab.all_reduce(x, algorithm=algorithm)
    dist.barrier()
    t0 = time.monotonic()
    if rank == victim:
        threading.Timer(delay_s, os.kill, (os.getpid(), signal.SIGKILL)).start()
    calls = 0
    try:
        while time.monotonic() - t0 < delay_s + 30:
            commlab.all_reduce(x.fill_(1.0), algorithm=algorithm)
            calls += 1
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return {"type": type(e).__name__, "commlab": isinstance(e, commlab.CommlabError), "msg": str(e)[:400],
                "after_kill_s": time.monotonic() - t0 - delay_s, "calls": calls,
                "leftovers": [n for n in os.listdir("/dev/shm") if n.startswith("commlab-")]}
    return {"type": None, "calls": calls}


@pytest.mark.parametrize("algorithm", quick_for(commlab.algorithms.for_device("cpu"), quick=("shm",)))
def test_rank_killed_inside_a_collective(algorithm):
    # A delay per algorithm, fixed so a failure reproduces, spread so the kill lands at
    # different phases of a call.
    delay = 0.2 + 0.37 * (commlab.algorithms.for_device("cpu").index(algorithm) % 5)
    pool = RankPool(3, pg_timeout_s=10)
    res = pool.outcomes(killed_mid_collective, algorithm, 1, delay, timeout=90)
    assert res[1].status == "missing", res[1]
    for r in (0, 2):
        status, payload = status_payload(res[r])
        assert status == "ok", payload
        assert payload["type"] is not None, f"rank {r} never noticed the dead peer: {payload}"
        assert payload["commlab"] and (f"[{algorithm}]" in payload["msg"] or f"[{algorithm}->" in payload["msg"]), payload
        assert payload["after_kill_s"] < 10 + 5, payload  # the group's timeout plus a margin
        assert payload["leftovers"] == [], payload
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("commlab-")]


def retry_after_timeout(rank, p):
    """Rank 0's call times out (rank 1 is late); its receives stay posted in gloo, so a
    retry on the group could pair with rank 1's late traffic. The retry must refuse."""
    import datetime

    g = dist.new_group(list(range(p)), timeout=datetime.timedelta(seconds=2))
    x = torch.full((5000,), float(rank + 1))
    out = {}
    if rank == 1:
        time.sleep(3)
    for name in ("first", "retry"):
        t0 = time.monotonic()
        try:
            commlab.all_reduce(x, group=g, algorithm="ring")
            out[name] = ("ok", x.unique().tolist())
        except commlab.CommlabError as e:
            out[name] = (type(e).__name__, str(e)[:300], round(time.monotonic() - t0, 2))
        if rank == 1:
            break
    return out


def test_a_group_whose_transfer_failed_refuses_reuse():
    pool = RankPool(2, pg_timeout_s=10)
    res = pool.outcomes(retry_after_timeout, timeout=60)
    (s0, r0), (s1, r1) = status_payload(res[0]), status_payload(res[1])
    assert s0 == "ok" and s1 == "ok", res
    assert r0["first"][0] == "PeerError", r0
    assert r0["retry"][:2] == r0["first"][:2], r0  # the group's failure again, the same error and text
    assert r0["retry"][2] < 0.5, r0  # refused at once, nothing posted
    assert r1["first"][0] == "PeerError", r1  # the late rank finds no partner: an error, never a pairing


_ORPHAN_PARENT = """
import sys, time
from commlab.measure.pools import RankPool


def block(rank, world):
    time.sleep(600)


if __name__ == "__main__":
    pool = RankPool(2, backend=None)
    pool.submit(block)
    print(pool.pid(0), pool.pid(1), pool._dir, flush=True)
    time.sleep(600)
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie has ended
    except (FileNotFoundError, ProcessLookupError):  # the read of a process ending as it is read fails ESRCH
        return True


@pytest.mark.parametrize("signal_name", ["SIGKILL", pytest.param("SIGTERM", marks=pytest.mark.slow)])
def test_ranks_end_when_the_process_that_started_them_dies(tmp_path, signal_name):
    """A compare run or test session killed (a scheduler's SIGTERM, an OOM killer's SIGKILL)
    must not leave its ranks training on for minutes, nor their working directory."""
    import signal
    import subprocess
    import sys

    script = tmp_path / "parent.py"
    script.write_text(_ORPHAN_PARENT)
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    ranks = []
    try:
        first, second, workdir = parent.stdout.readline().split()
        ranks += [int(first), int(second)]
        assert not any(_gone(p) for p in ranks)
        parent.send_signal(getattr(signal, signal_name))
        parent.wait(10)
        deadline = time.monotonic() + 10
        while not all(_gone(p) for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        alive = [p for p in ranks if not _gone(p)]
        assert not alive, f"ranks {alive} outlived the process that started them"
        assert not os.path.exists(workdir), f"{workdir} left behind"
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()
        for p in ranks:  # a failed test leaves nothing running
            try:
                os.kill(p, 9)
            except ProcessLookupError:
                pass


_UNCLOSED_PARENT = """
from commlab.measure.pools import RankPool


def rank_of(rank, world):
    return rank


if __name__ == "__main__":
    pool = RankPool(2)
    assert pool.run(rank_of) == [0, 1]
    print(pool.pid(0), pool.pid(1), pool._dir, flush=True)
"""


@pytest.mark.slow  # a fresh interpreter: the quick tier keeps the pool whose rank cannot start
def test_a_pool_left_open_at_exit_leaves_nothing_behind(tmp_path):
    """A script (or a test) that returns without closing its pool: multiprocessing's exit
    handler terminated the ranks before their lifeline could remove the pool's working
    directory, which stayed in the temporary directory for good."""
    import subprocess
    import sys

    script = tmp_path / "parent.py"
    script.write_text(_UNCLOSED_PARENT)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, second, workdir = proc.stdout.split()
    deadline = time.monotonic() + 10
    while not (_gone(int(first)) and _gone(int(second))) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(int(first)) and _gone(int(second))
    assert not os.path.exists(workdir), f"{workdir} left behind"


def _open_fds() -> set[str]:
    """This process's open descriptors. Each is checked once the listing is done: the
    listing's own descriptor of /proc/self/fd is among the names it read, and another
    number each time the numbers below it shift (read as a leak that was gone a moment
    later)."""
    names = os.listdir("/proc/self/fd")
    out = set()
    for name in names:
        try:
            os.fstat(int(name))
        except OSError:
            continue
        out.add(name)
    return out


def test_a_pool_whose_rank_cannot_start_leaves_nothing_behind(monkeypatch):
    """A rank's start() can fail (no processes or descriptors left): the ranks already
    started, the lifeline's two ends and the working directory must go with the error, not
    stay until the launching process exits (a test session starts hundreds of pools)."""
    import gc
    import glob
    import tempfile

    from commlab.measure import pools

    real = pools._context()
    started = []

    class Unstartable:
        pid = None

        def start(self):
            raise OSError(24, "Too many open files")

    class Ctx:
        def __getattr__(self, name):
            return getattr(real, name)

        def Process(self, *a, **k):  # noqa: N802 - multiprocessing's name
            if started:  # the second rank's
                return Unstartable()
            started.append(real.Process(*a, **k))
            return started[-1]

    pools.RankPool(1, backend=None).close()  # the fork server up: its descriptors are this process's for good
    monkeypatch.setattr(pools, "_context", lambda: Ctx())
    fds = _open_fds()
    dirs = set(glob.glob(os.path.join(tempfile.gettempdir(), "commlab-ranks-*")))
    with pytest.raises(OSError, match="Too many open files"):
        pools.RankPool(2, backend=None)
    gc.collect()  # the pool's queues close their pipes when collected; the lifeline's raw ends never would
    assert len(started) == 1
    started[0].join(10)
    assert not started[0].is_alive(), "the rank that started outlived its pool's failure"
    started[0].close()  # this test's own hold on it (its pipes to the fork server)
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "commlab-ranks-*"))) == dirs
    leaked = _open_fds() - fds
    assert not leaked, {fd: os.readlink(f"/proc/self/fd/{fd}") for fd in leaked if os.path.exists(f"/proc/self/fd/{fd}")}
