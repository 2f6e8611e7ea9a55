"""The CUDA `ipc` algorithm: path choice (runs anywhere), refusals, and on a GPU the
P2P kernels (several communicators in one process, one stream each, so one GPU can
run them concurrently), their deadline, and the host-staged path with 2 and 4
processes sharing the GPU."""
import contextlib
import threading

import pytest
import torch
from ranks import sigint_raises

import commlab
from commlab.core import ext as _ext
from commlab.core.errors import UnsupportedError
from commlab.transports import ipc


def facts(uuids, reach=None, hosts=None):
    out = []
    for r, u in enumerate(uuids):
        seen = {v: True for v in set(uuids) if v != u} if reach is None else reach[r]
        out.append({"host": (hosts or ["h"] * len(uuids))[r], "uuid": u, "index": r, "pid": 100 + r, "reach": seen})
    return out


def test_distinct_peer_gpus_take_p2p():
    path, why = ipc.choose_path(facts(["a", "b", "c", "d"]))
    assert path == ipc.PATH_PEER, why


def test_shared_gpu_is_staged_and_names_the_ranks():
    path, why = ipc.choose_path(facts(["a", "a", "b", "b"]))
    assert path == ipc.PATH_STAGED
    assert "[0, 1, 2, 3]" in why and "share a GPU" in why


def test_missing_p2p_is_staged():
    # The seed's RTX 4090s: each GPU sees the others but cannot access them.
    reach = [{"b": False}, {"a": False}]
    path, why = ipc.choose_path(facts(["a", "b"], reach))
    assert path == ipc.PATH_STAGED and "cannot access" in why
    # A rank that does not even see its peer's GPU (CUDA_VISIBLE_DEVICES per rank).
    path, why = ipc.choose_path(facts(["a", "b"], [{}, {}]))
    assert path == ipc.PATH_STAGED and "does not see" in why


def test_one_way_p2p_is_not_enough():
    path, _ = ipc.choose_path(facts(["a", "b"], [{"b": True}, {"a": False}]))
    assert path == ipc.PATH_STAGED


def test_more_ranks_than_the_kernels_take_are_staged():
    uuids = [f"g{i}" for i in range(ipc.MAX_P2P_RANKS + 1)]
    assert ipc.choose_path(facts(uuids))[0] == ipc.PATH_STAGED


def test_two_hosts_are_refused():
    path, why = ipc.choose_path(facts(["a", "b"], hosts=["h1", "h2"]))
    assert path is None and "more than one host" in why


def test_forced_path_and_bad_override():
    assert ipc.choose_path(facts(["a", "a"]), "peer")[0] == ipc.PATH_PEER
    path, why = ipc.choose_path(facts(["a", "b"]), "nvlink")
    assert path is None and "COMMLAB_IPC_PATH" in why


def test_ipc_is_a_cuda_algorithm():
    alg = commlab.get_algorithm("ipc")
    assert alg.devices == ("cuda",)
    assert "ipc" in commlab.algorithms.for_device("cuda")
    assert "ipc" not in commlab.algorithms.for_device("cpu")


def cpu_tensor_refused(rank, p):
    try:
        commlab.all_reduce(torch.ones(3), algorithm="ipc")
    except UnsupportedError as e:
        return str(e)
    return None


def test_cpu_tensors_are_refused_on_every_rank(ranks):
    for msg in ranks.run(2, cpu_tensor_refused):
        assert msg and "tensors on cpu are not supported" in msg and "cuda" in msg


# --- on a GPU ---------------------------------------------------------------

needs_kernels = pytest.mark.skipif(not _ext.HAS_CUDA, reason="commlab._C built without CUDA")


@contextlib.contextmanager
def local_group(world, capacity=1 << 16, timeout_ms=20_000, blocks=4):
    """`world` communicators in this process, wired to each other's blocks."""
    comms = [_ext.C.IpcComm(r, world, 0, capacity, timeout_ms, list(range(world))) for r in range(world)]
    try:
        for c in comms:
            c.max_blocks = blocks  # world*blocks blocks must be resident together on one GPU
            c.connect_local([d.block_address for d in comms])
        yield comms
    finally:
        for c in comms:
            c.close()


def run_concurrently(comms, tensors, op, mode):
    """Each communicator on its own thread and stream, like ranks in their processes."""
    errors = [None] * len(comms)
    torch.cuda.synchronize()  # the inputs' uploads ran on the default stream

    def one(r):
        try:
            with torch.cuda.stream(torch.cuda.Stream()):
                comms[r].allreduce(tensors[r], op, mode)
        except Exception as e:  # noqa: BLE001
            errors[r] = e

    threads = [threading.Thread(target=one, args=(r,)) for r in range(len(comms))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "an ipc call hung past its deadline"
    return errors


OPS = {0: torch.add, 1: torch.mul, 2: torch.minimum, 3: torch.maximum}


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("mode", [1, 2, 0])
def test_p2p_kernels_in_one_process(world, mode):
    with local_group(world) as comms:
        for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8):
            # 1, odd, not divisible by world, and larger than a 64 KiB buffer (pieces).
            for n in (1, 7, 1000, 40_001):
                for op, fold in OPS.items():
                    if op == 1 and dtype != torch.float64:
                        base = [torch.randint(1, 3, (n,), dtype=torch.int64) for _ in range(world)]
                    else:
                        base = [torch.randint(0, 50, (n,), dtype=torch.int64) for _ in range(world)]
                    inputs = [b.to(dtype) for b in base]
                    want = inputs[0].to(torch.float64)
                    for x in inputs[1:]:
                        want = fold(want, x.to(torch.float64))
                    tensors = [x.cuda() for x in inputs]
                    errors = run_concurrently(comms, tensors, op, mode)
                    assert errors == [None] * world, errors
                    got = [t.cpu() for t in tensors]
                    for r in range(1, world):
                        assert torch.equal(got[r], got[0]), f"rank {r} differs ({dtype}, n={n}, op={op})"
                    assert torch.equal(got[0], want.to(dtype)), f"{dtype} n={n} op={op} mode={mode}"


@pytest.mark.gpu
@needs_kernels
def test_p2p_random_floats_are_bitwise_identical():
    with local_group(4) as comms:
        for n in (3, 5000, 100_000):
            tensors = [torch.randn(n, device="cuda") for _ in range(4)]
            assert run_concurrently(comms, tensors, 0, 0) == [None] * 4
            for t in tensors[1:]:
                assert torch.equal(t, tensors[0])


@pytest.mark.gpu
@needs_kernels
def test_p2p_deadline_names_the_missing_rank():
    with local_group(2, timeout_ms=300) as comms:
        x = torch.ones(1000, device="cuda")
        with pytest.raises(RuntimeError, match=r"waited for rank 1 at the start barrier"):
            comms[0].allreduce(x, 0, 0)  # rank 1 never comes
        assert comms[0].failed_peer == 1
        with pytest.raises(RuntimeError, match="unusable after an earlier failure"):
            comms[0].allreduce(x, 0, 0)


@pytest.mark.gpu
@needs_kernels
def test_p2p_mismatched_calls_fail_on_every_rank():
    with local_group(2) as comms:
        tensors = [torch.ones(1000, device="cuda"), torch.ones(999, device="cuda")]
        errors = run_concurrently(comms, tensors, 0, 1)
        for e in errors:
            assert isinstance(e, RuntimeError) and "mismatch" in str(e), errors
        assert "1000 elements" in str(errors[0]) and "999 elements" in str(errors[0])


@pytest.mark.gpu
@needs_kernels
def test_p2p_an_empty_call_against_a_non_empty_one_fails_on_every_rank_at_once():
    """An empty tensor's call takes part in the kernels' record check (it returned at
    once, and its peer waited for the deadline, blaming a missing rank)."""
    import time

    with local_group(2) as comms:
        tensors = [torch.ones(0, device="cuda"), torch.ones(4096, device="cuda")]
        t0 = time.monotonic()
        errors = run_concurrently(comms, tensors, 0, 1)
        assert all(isinstance(e, RuntimeError) and "mismatch" in str(e) for e in errors), errors
        assert time.monotonic() - t0 < 2.0
        assert "0 elements" in str(errors[0]) and "4096 elements" in str(errors[0])


def staged_sweep(rank, p):
    torch.cuda.set_device(0)
    out = []
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for n in (1, 3, 1000, 100_003):
            x = (torch.arange(n, device="cuda") % 11 + rank).to(dtype)
            commlab.all_reduce(x, algorithm="ipc")
            want = (p * (torch.arange(n, device="cuda") % 11) + sum(range(p))).to(dtype)
            if not torch.equal(x, want):
                out.append(f"{dtype} n={n}: {(x != want).sum().item()} wrong")
    y = torch.randn(64, 65, device="cuda").t()  # non-contiguous, different on every rank
    commlab.all_reduce(y, op=torch.distributed.ReduceOp.MAX, algorithm="ipc")
    y = y.cpu().contiguous()
    gathered = [torch.empty_like(y) for _ in range(p)]
    torch.distributed.all_gather(gathered, y)
    if any(not torch.equal(g, gathered[0]) for g in gathered):
        out.append("ranks differ")
    path, _ = ipc.path_of(torch.distributed.group.WORLD)
    return out, path


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_staged_path_with_processes_sharing_a_gpu(ranks, world):
    for wrong, path in ranks.run(world, staged_sweep):
        assert path == ipc.PATH_STAGED
        assert not wrong, wrong


# --- setup agreement and failed setups, on CPU with stand-ins for the GPU facts ---------

class _FakeIpcComm:
    """Stands in for commlab._C.IpcComm; the rank in `fail_on` cannot allocate."""

    fail_on = -1

    def __init__(self, rank, world, device, capacity, timeout_ms, global_ranks):
        if rank == self.fail_on:
            raise RuntimeError("CUDA error: out of memory (stand-in)")
        self.closed = False

    def handle(self):
        return b"h"

    def open(self, handles):
        pass

    def close(self):
        self.closed = True


def _fake_ipc(monkeypatch, rank, fail_on=-1):
    class Ext:
        IpcComm = type("IpcComm", (_FakeIpcComm,), {"fail_on": fail_on})

    monkeypatch.setattr(ipc, "device_facts", lambda device: {
        "host": "h", "uuid": f"gpu{rank}", "index": 0, "pid": 100 + rank,
        "reach": {f"gpu{q}": True for q in range(8) if q != rank}})
    monkeypatch.setattr(ipc.ext, "require", lambda: Ext)


def failed_setup_raises_again(rank, p):
    import torch.distributed as dist

    mp = pytest.MonkeyPatch()
    try:
        _fake_ipc(mp, rank, fail_on=1)
        g = dist.new_group(list(range(p)))
        info = commlab.core.groups.resolve(g)
        seen = []
        for _ in range(2):  # the second call must meet the same error, not a half-made entry
            try:
                ipc.all_reduce(torch.ones(4), 0, 0, info, "ipc")
                seen.append(("NOT RAISED", ""))
            except Exception as e:  # noqa: BLE001 - the test compares them
                seen.append((type(e).__name__, str(e)))
        dist.destroy_process_group(g)
        return seen
    finally:
        mp.undo()


def test_a_failed_setup_raises_the_same_error_again(ranks):
    res = ranks.run(2, failed_setup_raises_again)
    for seen in res:
        (t1, m1), (t2, m2) = seen
        assert t1 == "CommlabError" and "allocating CUDA IPC buffers failed on rank(s) [1]" in m1, seen
        assert (t2, m2) == (t1, m1), seen
    assert res[0] == res[1]


def different_settings(rank, p, knob, value):
    import torch.distributed as dist

    mp = pytest.MonkeyPatch()
    try:
        _fake_ipc(mp, rank)
        if rank == 1:
            if knob == "COMMLAB_IPC_PATH":
                mp.setenv(knob, value)
            else:
                mp.setattr(ipc, ipc.KNOBS[knob].upper(), value)
        g = dist.new_group(list(range(p)))
        info = commlab.core.groups.resolve(g)
        try:
            ipc.all_reduce(torch.ones(4), 0, 0, info, "ipc")
            out = ("NOT RAISED", "")
        except Exception as e:  # noqa: BLE001 - the test inspects it
            out = (type(e).__name__, str(e))
        dist.destroy_process_group(g)
        return out
    finally:
        mp.undo()


@pytest.mark.parametrize("knob,value", [("COMMLAB_IPC_MAX_BLOCKS", 16), ("COMMLAB_IPC_CAPACITY", 1 << 20),
                                        ("COMMLAB_IPC_ONESHOT_MAX", 1024), ("COMMLAB_IPC_PATH", "staged")])
def test_ranks_must_agree_on_grid_capacity_and_path(ranks, knob, value):
    res = ranks.run(2, different_settings, knob, value)
    assert res[0] == res[1], res
    kind, msg = res[0]
    assert kind == "CollectiveMismatchError" and knob in msg and "rank 1" in msg, res


@pytest.mark.gpu
@needs_kernels
def test_p2p_flags_are_64_bit():
    """Flags read "this call or later". With 32-bit flags, 2^31 calls into a
    communicator's life a stale slot read as a later call and a barrier passed without
    its peer; the calls also cross 2^32, where a 32-bit counter wraps."""
    with local_group(2, timeout_ms=300) as comms:
        tensors = [torch.ones(1000, device="cuda") for _ in range(2)]
        assert run_concurrently(comms, tensors, 0, 0) == [None, None]  # slots now hold call 1
        for c in comms:
            c.calls = (1 << 32) - 2
        for k in range(4):
            tensors = [torch.full((1000,), float(r + 1), device="cuda") for r in range(2)]
            assert run_concurrently(comms, tensors, 0, 0) == [None, None], k
            assert all(torch.equal(t, torch.full_like(t, 3.0)) for t in tensors), k
    with local_group(2, timeout_ms=300) as comms:
        tensors = [torch.ones(1000, device="cuda") for _ in range(2)]
        assert run_concurrently(comms, tensors, 0, 0) == [None, None]
        comms[0].calls = (1 << 31) + 1  # rank 1's slot still says call 1
        with pytest.raises(RuntimeError, match=r"waited for rank 1 at the start barrier"):
            comms[0].allreduce(tensors[0], 0, 0)  # rank 1 never comes: must not pass


@pytest.mark.gpu
@needs_kernels
def test_p2p_ctrl_c_stops_the_kernels_and_the_peer_fails_fast():
    import os
    import signal
    import time

    with local_group(2, timeout_ms=20_000) as comms:
        x = torch.ones(1000, device="cuda")
        with sigint_raises():
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
            t0 = time.monotonic()
            with pytest.raises(KeyboardInterrupt):
                comms[0].allreduce(x, 0, 0)  # rank 1 is not calling
        assert time.monotonic() - t0 < 1.5
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="interrupted"):
            comms[1].allreduce(torch.ones(1000, device="cuda"), 0, 0)
        assert time.monotonic() - t0 < 2
