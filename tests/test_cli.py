"""The benchmark CLI and the cost model: their units, the floors set against the rows, the
refusals before a run, the ranks' server (the runs whose outputs alone are checked start
ahead, two at a time: tests/test_cli_runs.py)."""
import json
import os
import subprocess
import sys

import pytest
import torch
from ranks import run_main

import commlab
from commlab.core.units import format_bytes, parse_bytes
from commlab.measure import bench, costmodel, pools, probes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args, timeout=240):
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("flag", ["--json", "--plot", "--csv", "--trace"])
def test_an_output_that_cannot_be_written_is_refused_before_the_run(tmp_path, flag, monkeypatch, capfd):
    """Rank 0 writes the outputs after the run: a path it could not write failed it there,
    while its peer waited out the group's timeout in the closing barrier (120 s). Now the
    command is refused (argparse's exit 2) before any rank starts."""
    bad = tmp_path / "no-such-dir" / "r.out"
    started = []
    monkeypatch.setattr(pools, "run_once", lambda *a, **k: started.append(a))
    ran = run_main(bench.main, ["--world-size", "2", "-b", "4K", "-e", "4K", "--algorithms", "shm", "--anchors", "none",
                                flag, str(bad)], monkeypatch, capfd)
    assert ran.returncode == 2 and not started
    assert str(bad.parent) in ran.stderr


def test_a_gpu_trace_is_refused_before_the_run():
    from commlab.measure.bench import output_problem, parser

    args = parser().parse_args(["--device", "cuda", "--trace", "t.json"])
    assert "CPU tensors only" in output_problem(args)


@pytest.mark.slow
def test_costmodel_recovers_known_parameters(tmp_path, monkeypatch, capfd):
    alpha, beta, gamma = 50.0, 1e-3, 2e-4  # us, us/B, us/B
    p = 4
    results = []
    for alg in ["ring", "ps", "rd", "rhd"]:
        for n in [2**k for k in range(3, 27, 2)]:
            t = commlab.get_algorithm(alg).cost(p, n).time(alpha, beta, gamma)
            results.append({"algorithm": alg, "bytes": n, "time_us": t})
    fits = costmodel.fit([(r["algorithm"], p, r["bytes"], r["time_us"]) for r in results], gamma)
    for f in fits.values():
        assert f.alpha_us == pytest.approx(alpha, rel=1e-6)
        assert f.beta_us_per_byte == pytest.approx(beta, rel=1e-6)
        assert f.max_rel_err < 1e-9
    doc = {"env": {"world_size": p, "gamma_us_per_byte": gamma}, "results": results}
    src = tmp_path / "bench.json"
    src.write_text(json.dumps(doc))
    pred = tmp_path / "pred.json"
    proc = run_main(costmodel.main, ["--from", str(src), "--ranks", "8,64", "--bytes", "1M,100M", "--holdout",
                                     "--json", str(pred)], monkeypatch, capfd)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(pred.read_text())
    ring = [x for x in got["predictions"] if x["ranks"] == 64 and x["bytes"] == 100 << 20][0]["time_us"]["ring"]
    assert ring == pytest.approx(commlab.get_algorithm("ring").cost(64, 100 << 20).time(alpha, beta, gamma), rel=1e-6)
    assert all(v["max_rel_err"] < 1e-6 for v in got["holdout"].values())


def test_units():
    assert parse_bytes("4K") == 4096 and parse_bytes("1M") == 1 << 20 and parse_bytes("1G") == 1 << 30
    assert parse_bytes("64") == 64 and format_bytes(1 << 20) == "1M" and format_bytes(100) == "100"
    with pytest.raises(ValueError):
        parse_bytes("12Q")


class _Clock:
    """A clock whose calls take 2 ms on alternate iterations, rank 0 on even ones and
    rank 1 on odd ones: ranks that take turns being late, as descheduled ranks do."""

    cuda = False

    def __init__(self, rank):
        self.rank, self.now, self.n = rank, 0.0, 0

    def mark(self):
        self.n += 1
        if self.n % 2 == self.rank:
            self.now += 2e-3
        return self.now

    def durations_us(self, marks):
        return [(b - a) * 1e6 for a, b in zip(marks, marks[1:])]


def _bench_timing(rank, p):
    from commlab.measure.timing import Interleaved
    clock = Interleaved(device=torch.device("cpu"), iters=8, warmup=1, blocking=False, budget_s=1, max_iters=8,
                        rounds=2)
    clock.clock = _Clock(rank)
    for _ in range(clock.rounds):
        clock.round("x", lambda: None)
    t = clock.result("x")
    return t.mean_us, t.median_us, t.iters


def test_bench_time_is_the_loop_time_of_the_slowest_rank(ranks):
    """Each call's slowest rank always took 2 ms, yet every rank's loop ran 1 ms per call:
    the headline is the loop's (nccl-tests'), the per-call median shows the other view."""
    for mean_us, median_us, iters in ranks.run(2, _bench_timing):
        assert iters == 8
        assert median_us == pytest.approx(2000.0)
        assert mean_us == pytest.approx(1000.0)


def _blocking_barriers(rank, p):
    from commlab.measure.timing import Interleaved

    events = []
    clock = Interleaved(device=torch.device("cpu"), iters=4, warmup=1, blocking=True, budget_s=1, max_iters=4,
                        rounds=1)
    clock.round("x", lambda: events.append("call"), lambda: events.append("barrier"))
    return events


def test_isolated_calls_start_from_the_rows_own_barrier(ranks):
    """--blocking: every timed call comes right after the row's transport barrier (not
    gloo's, which releases ranks sharing cores milliseconds apart)."""
    for events in ranks.run(2, _blocking_barriers):
        timed = events[events.index("barrier"):]  # after the untimed setup/warm-up calls
        assert timed == ["barrier", "call"] * 4, events


def _planned_iterations(rank, p):
    from commlab.measure import timing

    class Clock:  # the module's time, advanced by each call's own duration
        now = 0.0

        @classmethod
        def perf_counter(cls):
            return cls.now

    state = {"n": 0}

    def call():  # the first calls slow, as a new size's faults make them, then ~1 ms (exact in binary)
        state["n"] += 1
        Clock.now += 2.0 ** -5 if state["n"] <= 3 else 2.0 ** -10

    saved, timing.time = timing.time, Clock
    try:
        clock = timing.Interleaved(device=torch.device("cpu"), iters=None, warmup=4, blocking=False,
                                   budget_s=0.125, max_iters=1000, rounds=1)
        return clock._plan(call)
    finally:
        timing.time = saved


def test_a_row_whose_first_calls_are_slow_still_fills_its_budget(ranks):
    """1/8 s of 1/1024 s calls is 128 iterations; planned from the mean of the warm-up
    calls (two of 1/32 s, two of 1/1024 s) it was 7. The module's clock is faked."""
    for n in ranks.run(2, _planned_iterations):
        assert n == 128, n


def _collector_while_timed(rank, p):
    import gc

    from commlab.measure.timing import Interleaved

    seen = {}
    for blocking in (False, True):
        clock = Interleaved(device=torch.device("cpu"), iters=4, warmup=1, blocking=blocking, budget_s=1,
                            max_iters=4, rounds=1)
        states = []
        clock.round("x", lambda: states.append(gc.isenabled()))
        seen[blocking] = states
    return seen, gc.isenabled()


def test_the_garbage_collector_is_off_while_calls_are_timed(ranks):
    """As timeit does: a collection of the whole process's objects (tens of ms where torch
    is loaded), set off by garbage another row made, landed in whichever row was being
    timed (shm's 256 KiB all-to-all at 2 ranks: 15-17 us beside gloo's row, 9 alone). The
    untimed warm-up runs with it on; the collector is on again afterwards."""
    for seen, after in ranks.run(2, _collector_while_timed):
        for states in seen.values():
            assert states[:2] == [True, True] and not any(states[2:]), states  # plan's calls, then timed ones
        assert after


@pytest.mark.parametrize("n", [2, 3, 4, 7])
def test_no_row_is_always_timed_after_the_same_row(n):
    """Across the default rounds every row is timed after at least two different
    predecessors (the first of a run has none): shm's row always followed gloo's, whose
    sleeping ranks woke on one core and slowed the next row's calls for tens of ms."""
    from commlab.measure.bench import parser
    from commlab.measure.timing import round_order

    rows = list(range(n))
    rounds = parser().parse_args([]).rounds
    sequence = [r for k in range(rounds) for r in round_order(rows, k)]
    for k in range(rounds):
        assert sorted(round_order(rows, k)) == rows
    for row in rows:
        before = {sequence[i - 1] if i else None for i, r in enumerate(sequence) if r == row}
        assert len(before) >= 2, (row, sequence)


def _gather_row_buffers(rank, p):
    from commlab.core.reduction import Op
    from commlab.measure.rows import registry_rows

    row = registry_rows(["ring"], torch.device("cpu"), "all_gather")[0]
    x = torch.ones(1000)
    seen = set()
    for _ in range(3):  # what --blocking does: the row's barrier, then the timed call
        row.barrier()
        row.call(x, Op.SUM)
        seen.add(row.output(x).data_ptr())
    return len(seen), bool((row.output(x) == 1).all())


def test_an_isolated_all_gather_keeps_its_output_buffer(ranks):
    """The barrier's one-element gather shared the call's output buffer: every isolated
    call reallocated it (64 MiB outputs took 36 ms instead of 8)."""
    assert ranks.run(2, _gather_row_buffers) == [(1, True), (1, True)]


def test_one_gpu_per_nccl_rank_or_a_clear_error():
    from commlab.measure.launch import check_gpus_per_rank

    assert check_gpus_per_rank(4, "nccl", 4) is None
    assert check_gpus_per_rank(4, "gloo", 1) is None  # processes may share a GPU over gloo
    msg = check_gpus_per_rank(4, "nccl", 1)
    assert "4 ranks on this host but 1 GPU(s)" in msg and "--nproc_per_node=1" in msg
    assert "no CUDA device" in check_gpus_per_rank(1, "nccl", 0)


def test_launch_reads_the_local_world_size(monkeypatch):
    from commlab.measure import launch

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.delenv("COMMLAB_SPAWNED", raising=False)
    assert launch.detect() == launch.Launch("torchrun", 5, 8, 1, 4, "torchrun")


def test_the_mpi_anchor_names_its_library_and_stages_cuda_tensors(monkeypatch):
    import types

    import torch

    from commlab.core.reduction import Op
    from commlab.measure import launch, rows

    seen = []

    class Comm:
        def Get_size(self):
            return 2

        def Allreduce(self, inplace, buf, op):
            seen.append(type(buf).__name__)
            buf *= 2  # what a 2-rank SUM of equal inputs gives

        def Barrier(self):
            pass

    fake = types.SimpleNamespace(COMM_WORLD=Comm(), IN_PLACE=None, SUM="sum", PROD="prod", MIN="min", MAX="max",
                                 Get_library_version=lambda: "Open MPI v5.0.11, package: Open MPI\nmore")
    monkeypatch.setattr(launch, "mpi_world", lambda: (fake, None))
    monkeypatch.setattr(rows.dist, "get_world_size", lambda: 2)
    row = rows.mpi_row(torch.float32, Op.SUM, torch.device("cuda"))
    assert row.name == "mpi:openmpi:host-staged" and "Open MPI v5.0.11" in row.about
    t = torch.ones(4)
    row.call(t, Op.SUM)
    assert seen == ["ndarray"] and t.tolist() == [2.0] * 4
    assert rows.mpi_row(torch.float32, Op.SUM, torch.device("cpu")).name == "mpi:openmpi"
    assert "bfloat16" in rows.mpi_row(torch.bfloat16, Op.SUM, torch.device("cpu"))  # a reason, not a row


@pytest.mark.slow
def test_memory_floor_is_a_lower_bound(tmp_path, monkeypatch, capfd):
    """An efficiency above 100 % would be a bug in the floor: it is measured with every
    rank streaming at once (4 ranks share the 2 cores here), at the working-set size."""
    out = tmp_path / "r.json"
    proc = run_main(bench.main, ["--world-size", "4", "-b", "1M", "-e", "4M", "-f", "4", "--algorithms", "shm,shm_ps",
                                 "--budget", "0.1", "--rounds", "1", "--json", str(out)], monkeypatch, capfd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    effs = [float(line.rsplit("efficiency", 1)[1].strip(" %")) for line in proc.stdout.splitlines()
            if "-> efficiency" in line]
    assert len(effs) == 4, proc.stdout
    assert all(0 < e <= 100 for e in effs), effs
    env = json.loads(out.read_text())["env"]
    assert set(env["group_bandwidth_gbps"]) == {str(1 << 20), str(4 << 20)}
    assert "all ranks streaming" in proc.stdout


@pytest.mark.slow
def test_the_floors_can_be_left_out_and_this_hosts_fit_leaves_them_out(tmp_path, monkeypatch, capfd):
    """compare's this-host fit reads the rows alone; the floors it had the bench measure
    were 2.2 s of an 8 s run, once per collective fitted."""
    out = tmp_path / "r.json"
    proc = run_main(bench.main, ["--world-size", "2", "-b", "4K", "-e", "1M", "-f", "256", "--algorithms", "shm",
                                 "--anchors", "none", "--budget", "0.02", "--rounds", "1", "--no-floors", "--json",
                                 str(out)], monkeypatch, capfd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    env = json.loads(out.read_text())["env"]
    assert not {"group_bandwidth_gbps", "handoffs", "hot_copy_us"} & set(env), env
    assert "efficiency" not in proc.stdout and ": floor" not in proc.stdout
    from commlab.experiments.compare import calibrate

    seen = []

    def fake_main(argv):
        seen.append(argv)
        with open(argv[argv.index("--json") + 1], "w") as f:
            json.dump({"env": {}, "results": []}, f)
        return 0

    monkeypatch.setattr(calibrate.bench, "main", fake_main)
    calibrate.host_bench(4, "all_reduce", ["builtin"])
    assert "--no-floors" in seen[0] and "--no-table" in seen[0]  # its table would land in compare's


def test_clock_offsets_are_found_within_the_error_they_state():
    """Three ranks (threads on one store) whose clocks read rank 0's + 0, + 5 s and - 2.5 s:
    each finds its offset to rank 0 within its stated error, which is half a round trip."""
    import datetime
    import threading
    import time

    import torch.distributed as dist

    from commlab.measure.clocks import offset_to_rank0

    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=30))
    shifts, got = {0: 0.0, 1: 5.0, 2: -2.5}, {}

    def rank(r):
        got[r] = offset_to_rank0(store, r, 3, clock=lambda: time.perf_counter() + shifts[r], name="test")

    threads = [threading.Thread(target=rank, args=(r,)) for r in shifts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got[0] == (0.0, 0.0)
    for r in (1, 2):
        offset, error = got[r]
        assert 0 < error < 0.5 and abs(offset + shifts[r]) <= error + 1e-6, (r, got[r])


def test_memory_floor_takes_the_larger_bound():
    from commlab.algorithms import Traffic

    t = Traffic(tensor=2e6, staging=3e6)
    # tensor at 1 GB/s: 2000 us; all 5e6 B at 10 GB/s: 500 us -> 2000
    assert probes.memory_floor_us(t, 1.0, 10.0) == pytest.approx(2000.0)
    # tensor at 10 GB/s: 200 us; all at 2 GB/s: 2500 us -> 2500
    assert probes.memory_floor_us(t, 10.0, 2.0) == pytest.approx(2500.0)


@pytest.mark.slow
def test_small_message_floor_is_measured_and_below_every_row(tmp_path, monkeypatch, capfd):
    """The 4 KiB floor (handoff + copy, + a switch per extra rank on a core) is measured
    in the run, every row's time is a multiple >= 1 of it, and the ping-pong segments
    are gone afterwards."""
    out = tmp_path / "r.json"
    proc = run_main(bench.main, ["--world-size", "4", "-b", "4K", "-e", "64K", "-f", "16", "--algorithms",
                                 "shm,builtin", "--anchors", "none", "--budget", "0.1", "--rounds", "1", "--json",
                                 str(out)], monkeypatch, capfd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    env = json.loads(out.read_text())["env"]
    h = env["handoffs"]
    assert 0 < h["handoff_us"] < 1000 and h["ranks_per_core"] == 2 and 0 < h["switch_us"] < 1000, h
    assert set(env["hot_copy_us"]) == {str(4 << 10), str(64 << 10)}
    lines = [line for line in proc.stdout.splitlines() if ": floor" in line and "switch" in line]
    assert len(lines) == 2, proc.stdout
    ratios = [float(x.rsplit(" ", 1)[1].rstrip("x")) for line in lines for x in line.split(";  ")[1].split(", ")]
    assert len(ratios) == 4 and all(r >= 1 for r in ratios), lines
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("commlab-handoff")]


def test_small_message_floor_arithmetic():
    from commlab.measure.table import small_floor_lines

    env = {"handoffs": {"handoff_us": 0.5, "switch_us": 2.0, "ranks_per_core": 3}, "hot_copy_us": {"4096": 0.25}}
    rows = [{"algorithm": "a", "bytes": 4096, "time_us": 9.0}, {"algorithm": "b", "bytes": 4096, "time_us": 4.5}]
    lines = small_floor_lines(rows, env)
    # 0.5 + 0.25 + (3 - 1) * 2.0 = 4.75
    assert "floor   4.75 us = handoff 0.50 + copy 0.25 + 2 x switch 2.00;  b 0.9x, a 1.9x" in lines[1], lines
    assert small_floor_lines(rows, {"handoffs": None, "hot_copy_us": {"4096": 0.25}}) == []


def test_deepspeed_anchor_is_checked_and_leaves_nothing_behind(tmp_path):
    """DeepSpeed's CPU shared-memory all-reduce as a row of the same run (when installed):
    its results are checked like commlab's, and its segments, which it never unlinks,
    are gone afterwards."""
    pytest.importorskip("deepspeed")
    out = tmp_path / "r.json"
    proc = _run(["-m", "commlab.allreduce_bench", "--world-size", "2", "-b", "4K", "-e", "64K", "-f", "4",
                 "--algorithms", "shm", "--anchors", "deepspeed", "--budget", "0.05", "--json", str(out)], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    ds = [r for r in doc["results"] if r["algorithm"] == "deepspeed_shm"]
    assert len(ds) == 3 and all(r["wrong"] == 0 for r in ds), ds
    assert "SUM" in doc["env"]["anchors"]["deepspeed_shm"]
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("deepspeed_allreduce_buffer")]


def _check_work_per_size(rank, p, collective):
    from unittest import mock

    from commlab.measure import bench, specs

    counts = {"inputs": 0, "wants": 0}
    real_input, real_reduced = specs.check_input, specs.reduced

    def counting_input(*a, **k):
        counts["inputs"] += 1
        return real_input(*a, **k)

    def counting_reduced(*a, **k):
        counts["wants"] += 1
        return real_reduced(*a, **k)

    args = bench.parser().parse_args(["--collective", collective, "-b", "1K", "-e", "4K", "-f", "4", "--algorithms",
                                      "builtin,ring,direct,rd", "--anchors", "none", "--quiet", "--budget", "0.001"])
    with mock.patch.object(bench, "check_input", counting_input), mock.patch.object(specs, "check_input", counting_input), \
            mock.patch.object(specs, "reduced", counting_reduced):
        results = bench.run_bench(args)["results"] if rank == 0 else bench.run_bench(args)
    return counts, results


def test_the_check_computes_what_each_rank_holds_once_per_size(ranks):
    """The #wrong check built each rank's input and what it must hold afterwards (for an
    all-reduce: every rank's input again, reduced exactly) once per row: at 64 MiB and 11
    rows that was most of the README's run (rank 0 spent 53 % of it there). Once per size
    now, whatever the number of rows; every row still checked."""
    counts, results = ranks.run(2, _check_work_per_size, "all_reduce")[0]
    assert [r["wrong"] for r in results] == [0] * 8, results  # 4 rows x 2 sizes
    assert counts["wants"] == 2, counts  # was 8: once per row
    assert counts["inputs"] <= 2 * (1 + 2), counts  # one input per size, plus the reduction's p: was 8 * 3


def _preloaded(rank, p):
    import sys

    return "torch._dynamo" in sys.modules


def test_ranks_start_with_what_ddp_imports_already_imported():
    """DistributedDataParallel's constructor imports torch._dynamo (and sympy with it):
    0.85 s of CPU in every rank of every pool that builds one, and compare's modes, the
    hooks' and the docs' examples start hundreds. The forkserver imports it once (this
    suite's conftest asks for it, as compare does)."""
    from commlab.measure.pools import RankPool

    pool = RankPool(2)
    try:
        assert pool.run(_preloaded) == [True, True]
    finally:
        pool.close()


def _server_preload(entry: str) -> list:
    """The modules an entry point's ranks' server imports: its first pool's preload."""
    code = ("import runpy, sys\n"
            "from commlab.measure import pools\n"
            "def stop(*a, **k):\n"
            "    print(sorted(pools._PRELOAD)); sys.exit(0)\n"
            "pools.RankPool.__init__ = stop\n"
            f"sys.argv = {entry.split()!r}\n"
            f"runpy.run_module(sys.argv[0], run_name='__main__')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return eval(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_only_the_entry_points_that_build_ddp_preload_dynamo():
    """The ranks' server imported torch._dynamo for every entry point: 0.9 s before the
    first rank of every bench (3.8 s in all for two ranks and one size), which never
    builds DDP. compare's ranks do, and get it."""
    bench = _server_preload("commlab.allreduce_bench --world-size 2 -b 4K -e 4K --algorithms shm --anchors none")
    assert "torch._dynamo" not in bench and "torch" in bench
    compare = _server_preload("commlab.compare --device cpu --world-size 2 --modes ddp --iters 1 --warmup 1")
    assert "torch._dynamo" in compare


@pytest.mark.parametrize("op", ["sum", "product", "min", "max", "avg"])
def test_the_check_patterns_are_the_formulas_tiled(op):
    """check_input and reduced build one period and tile it: element for element the
    formulas they stand for, at sizes around and well past the period."""
    import torch.distributed as dist

    from commlab.core.reduction import Op, finish_average_, parse_op
    from commlab.measure.specs import check_input, reduced

    o = parse_op(getattr(dist.ReduceOp, op.upper()))
    for dtype in (torch.float32, torch.bfloat16, torch.int32, torch.uint8, torch.float64):
        if o is Op.AVG and not dtype.is_floating_point:
            continue
        for count in (0, 1, 9, 10, 11, 1001):
            i = torch.arange(count, dtype=torch.int64)
            xs = [((i + r) % 2 + 1) if o is Op.PRODUCT else ((i * 7 + r * 3) % 5) for r in range(3)]
            for r in range(3):
                assert torch.equal(check_input(r, count, dtype, o, "cpu"), xs[r].to(dtype))
            s = torch.stack(xs)
            want = {Op.PRODUCT: s.prod(0), Op.MIN: s.amin(0), Op.MAX: s.amax(0)}.get(o, s.sum(0)).to(dtype)
            if o is Op.AVG:
                finish_average_(want, 3)
            assert torch.equal(reduced(3, count, dtype, o, "cpu"), want), (op, dtype, count)
