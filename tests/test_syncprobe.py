"""measure.syncprobe: collectives called after compute, as a training step calls them."""
import pytest

from commlab.measure import syncprobe


def test_the_probe_reads_what_compares_table_reads():
    """Per call: its time after the last rank arrived (per rank the mean, the largest
    rank's, as compare's table), how far apart the ranks leave it, and the wait."""
    calls = [[(0.0, 1.0), (2.0, 2.5)],  # rank 0: (start, end) of each call, one clock
             [(0.4, 1.2), (2.1, 2.5)]]  # rank 1 arrives 0.4 s, then 0.1 s, after rank 0
    got = syncprobe.summarise(calls, skip=0)
    assert got["after_us"] == pytest.approx(0.6e6)  # rank 1: (0.8 + 0.4) / 2; rank 0: (0.6 + 0.4) / 2
    assert got["exit_spread_us"] == pytest.approx(0.05e6)  # rank 0 left the first call 0.2 s early
    assert got["wait_us"] == pytest.approx(0.25e6)  # rank 0: (0.4 + 0.1) / 2
    # The first calls (transports set up, buffers faulted in) are left out by default.
    assert syncprobe.summarise([c + c[-1:] * 2 for c in calls])["after_us"] == pytest.approx(0.4e6)
    # The wait as one more synchronisation adds it: its mean over ranks and calls, ± over calls.
    assert got["wait_mean_us"] == pytest.approx(0.125e6)  # calls' rank means 0.2 and 0.05
    assert got["wait_mean_se_us"] == pytest.approx(0.075e6)
    assert "work_to_last_us" not in got
    # With each work's start: from it to the last arrival, the mean over ranks and calls.
    worked = [[(0.0, 1.0, -0.3), (2.0, 2.5, 1.5)], [(0.4, 1.2, -0.2), (2.1, 2.5, 1.6)]]
    assert syncprobe.summarise(worked, skip=0)["work_to_last_us"] == pytest.approx(0.6e6)  # .7 .6 .6 .5


def test_the_probes_buffers_are_made_as_fsdp2_makes_them():
    """Each call writes buffers allocated for it, as FSDP2's do (a fresh output's pages
    fault in inside the call: most of shm's 48 MiB all-gather in training), the input
    written before: an all-gather's shard in its own slice of the output, a
    reduce-scatter's full-size gradients."""
    out, inp = syncprobe.fsdp_buffers("all_gather", 8, rank=2, world=4)
    assert out.numel() == 32 and inp.numel() == 8 and inp.data_ptr() == out.data_ptr() + 16 * 4
    assert bool((out[16:24] == 1).all())
    out, inp = syncprobe.fsdp_buffers("reduce_scatter", 32, rank=2, world=4)
    assert out.numel() == 8 and inp.numel() == 32 and bool((inp == 1).all())
    assert inp.data_ptr() != out.data_ptr()


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter"])
def test_the_probe_runs_each_family_on_ranks_of_this_machine(collective):
    got = syncprobe.measure(2, collective, "shm", 1 << 16, work_ms=2.0, reps=4)
    assert got["bytes"] == 1 << 16 and got["reps"] == 4
    # Every call ends after every rank arrived; the wait and spread are differences of times.
    assert got["after_us"] > 0 and got["exit_spread_us"] >= 0 and got["wait_us"] >= 0


def test_compare_probes_the_collectives_its_fsdp_modes_call(monkeypatch):
    """--predict this-host probes each all-gather and reduce-scatter algorithm an fsdp mode
    calls (FSDP2's own is gloo's, builtin), once, and nothing for DDP or ZeRO-1."""
    from commlab.experiments.compare import calibrate

    seen = []
    monkeypatch.setattr(syncprobe, "measure_all", lambda world, calls, reps: [seen.append((world, *call[:2], *call[3:]))
                                                                              or {"x": len(seen)} for call in calls])
    got = calibrate.probe_in_training(4, ["ddp", "zero1", "fsdp", "fsdp:shm", "fsdp:noreshard"])
    # Each in both of the allocator's states: its output mapped afresh and recycled ("reused").
    assert sorted(seen) == sorted((4, c, n, s) for c in ("all_gather", "reduce_scatter") for n in ("builtin", "shm")
                                  for s in (syncprobe.FRESH, syncprobe.REUSED))
    order = {call[1:]: i + 1 for i, call in enumerate(seen)}
    assert got == {c: {n: {"x": order[(c, n, syncprobe.FRESH)], "reused": {"x": order[(c, n, syncprobe.REUSED)]}}
                       for n in ("builtin", "shm")} for c in ("all_gather", "reduce_scatter")}
    assert calibrate.probe_in_training(4, ["ddp", "zero1", "ddp:shm"]) == {}
    # At the size of the model's largest unit, where FSDP spends its time: a block of the
    # issue's transformer (width 1024: 12.6 M parameters, 48 MiB in fp32).
    sizes = []
    monkeypatch.setattr(syncprobe, "measure_all", lambda world, calls, reps: [sizes.append(n) or {} for _, _, n, _ in calls])
    calibrate.probe_in_training(4, ["fsdp"], calibrate.largest_unit_bytes({"model": "transformer", "width": 1024, "depth": 8}))
    assert set(sizes) == {12_596_224 * 4}


def test_compare_probes_ddps_bucket_all_reduces_in_place(monkeypatch):
    """With a bucket size, --predict this-host also probes each all-reduce a DDP-bucketed
    mode calls (ddp and zero1: DDP's own, builtin; ddp:<algorithm>: that one), at a full
    bucket of the model, and none for the compute-only step or a mode that names no
    algorithm (compare reports it unavailable); fewer calls where
    $COMMLAB_PROBE_REPS says so."""
    from commlab.experiments.compare import calibrate

    seen = []
    monkeypatch.setattr(syncprobe, "measure_all",
                        lambda world, calls, reps: [seen.append((c, name, n, reps)) or {"x": 1}
                                                    for c, name, n in calls])
    monkeypatch.setenv("COMMLAB_PROBE_REPS", "4")
    got = calibrate.probe_in_training(4, ["ddp:noop", "ddp", "zero1", "ddp:shm", "ddp:nope"], 1 << 20, ddp_bytes=3 << 20)
    assert got == {"all_reduce": {"builtin": {"x": 1}, "shm": {"x": 1}}}
    assert sorted(seen) == [("all_reduce", "builtin", 3 << 20, 4), ("all_reduce", "shm", 3 << 20, 4)]
    # A full bucket: --bucket-cap-mb in MiB, or the whole model's gradients where smaller.
    assert calibrate.full_bucket_bytes({"model": "transformer", "width": 1024, "depth": 8, "bucket_cap_mb": 25}) == 25 << 20
    assert calibrate.full_bucket_bytes({"model": "mlp", "width": 16, "depth": 2, "bucket_cap_mb": 25}) < 1 << 20


def test_the_probe_also_calls_into_buffers_the_allocator_recycled(monkeypatch):
    """FSDP2 allocates every call's output, and where it comes from is the allocator's state
    at that moment: a large output mapped afresh faults its pages in inside the call, one
    from a free heap chunk does not, and training sees both (docs/measurements.md, "What
    the tests rest on"). The probe times both: "reused" makes the buffers once
    and rewrites the input before every call, as FSDP2 copies it in."""
    made = []
    real = syncprobe.fsdp_buffers
    monkeypatch.setattr(syncprobe, "fsdp_buffers", lambda *a: made.append(real(*a)) or made[-1])
    for state, want in ((syncprobe.FRESH, 3), (syncprobe.REUSED, 1)):
        made.clear()
        prepare = syncprobe._caller(1, 2, "reduce_scatter", "shm", 1 << 12, state)
        for _ in range(3):
            if made:
                made[-1][1].zero_()  # the last call's input, spent
            assert callable(prepare())
            assert bool((made[-1][1] == 1).all()), state  # written before the call
        assert len(made) == want, state


def test_the_probe_reduces_a_bucket_in_place_on_ranks_of_this_machine():
    got = syncprobe.measure(2, "all_reduce", "shm", 1 << 16, work_ms=2.0, reps=4)
    assert got["bytes"] == 1 << 16 and got["after_us"] > 0 and got["exit_spread_us"] >= 0


def test_several_probes_run_on_one_set_of_ranks(monkeypatch):
    """Starting and joining a set of ranks took most of a short probe (1.7 s each of the
    docs' example's three): every probe of a sample runs on one set, each still its own."""
    from commlab.measure import pools

    launches = []
    real = pools.run_once
    monkeypatch.setattr(pools, "run_once", lambda *a, **kw: launches.append(a[0]) or real(*a, **kw))
    got = syncprobe.measure_all(2, [("all_reduce", "shm", 1 << 16), ("all_gather", "builtin", 1 << 12)],
                                work_ms=2.0, reps=4)
    assert launches == [2] and [g["bytes"] for g in got] == [1 << 16, 1 << 12]
    assert all(g["after_us"] > 0 and g["reps"] == 4 for g in got)
    assert syncprobe.measure_all(2, []) == [] and launches == [2]


def _zero_partition(rank, world, sizes):
    import torch
    from torch.distributed.optim import ZeroRedundancyOptimizer

    params = [torch.nn.Parameter(torch.zeros(n // 4)) for n in sizes]
    opt = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.SGD, lr=0.1)
    ids = {id(p): i for i, p in enumerate(params)}
    return [[ids[id(p)] for g in per_rank for p in g["params"]] for per_rank in opt._partition_parameters()]


def test_zero1s_owners_are_torchs():
    """The probe broadcasts each parameter from the rank torch's ZeroRedundancyOptimizer
    gives it, in its order (largest first, each to the rank holding the fewest bytes)."""
    from commlab.measure import pools

    sizes = [4096, 64, 8192, 4096, 256, 8192, 128, 4]  # ties in size and in bytes held
    outcomes = pools.run_once(2, _zero_partition, sizes, backend="gloo", timeout=60)
    assert not pools.report_failures(outcomes)
    assert outcomes[0].result == syncprobe.zero1_owners(sizes, 2) == [[2, 0, 4], [5, 3, 6, 1, 7]]


def test_the_probe_times_zero1s_broadcasts_issued_together():
    got = syncprobe.measure_all(2, [(syncprobe.ZERO1, "builtin", [1 << 16, 4096, 64])], work_ms=2.0, reps=4)[0]
    assert got["bytes"] == (1 << 16) + 4096 + 64 and got["sizes"] == [1 << 16, 4096, 64]
    assert got["after_us"] > 0 and got["exit_spread_us"] >= 0


def _zero1_steps(rank, world, sizes, optimizer):
    import torch

    stepped = []
    kind = getattr(torch.optim, syncprobe.OPTIMIZERS[optimizer])

    class Recording(kind):
        def step(self, *a, **kw):
            stepped.append(sorted(p.numel() * 4 for g in self.param_groups for p in g["params"]))
            return super().step(*a, **kw)

    setattr(torch.optim, kind.__name__, Recording)
    try:
        prepare = syncprobe._caller(rank, world, syncprobe.ZERO1, "builtin", sizes, optimizer)
        for _ in range(2):
            prepare()()
    finally:
        setattr(torch.optim, kind.__name__, kind)
    got = syncprobe.probe_rank(rank, world, [(syncprobe.ZERO1, "builtin", sizes, optimizer)], matmuls=10**6,
                               reps=2)[0]
    return stepped, max(t0 - w0 for t0, _end, w0 in got)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_zero1s_probe_steps_each_ranks_own_parameters_before_the_broadcasts(optimizer):
    """ZeRO-1's ranks step their own parameters at once (lined up by the buckets) and the
    broadcasts wait for the slowest: 4 ranks on 2 cores reached them far apart after their
    quarters of AdamW (docs/measurements.md, "What the tests rest on"), a wait the probe after
    fixed work never showed. With an optimizer named, each call follows that optimizer's step on the
    rank's own parameters, and that step is the work (no fixed work besides)."""
    from commlab.measure import pools

    sizes = [4096, 64, 8192, 4096, 256, 8192, 128, 4]
    outcomes = pools.run_once(2, _zero1_steps, sizes, optimizer, backend="gloo", timeout=60)
    assert not pools.report_failures(outcomes)
    owners = syncprobe.zero1_owners(sizes, 2)
    for r in range(2):
        stepped, before_call = outcomes[r].result
        assert stepped == [sorted(sizes[i] for i in owners[r])] * 2
        assert before_call < 5.0  # a million matmuls would take minutes: not made


def test_the_zero1_probe_reads_the_wait_at_the_broadcasts():
    got = syncprobe.measure_all(2, [(syncprobe.ZERO1, "builtin", [1 << 16, 4096, 64], "adamw")], reps=4)[0]
    assert got["state"] == "adamw" and got["work_to_last_us"] > 0
    assert got["wait_mean_us"] >= 0 and got["wait_mean_se_us"] >= 0


def test_compare_probes_zero1s_broadcasts_with_the_models_parameters(monkeypatch):
    from commlab.experiments.compare import calibrate

    seen = []
    monkeypatch.setattr(syncprobe, "measure_all", lambda world, calls, reps: [seen.append(c) or {"x": 1}
                                                                              for c in calls])
    args = {"model": "mlp", "width": 16, "depth": 2, "bucket_cap_mb": 25}
    got = calibrate.probe_in_training(4, ["ddp", "zero1"], 1 << 20, calibrate.full_bucket_bytes(args), calibrate.param_bytes(args),
                                "adamw")
    assert (syncprobe.ZERO1, "builtin", calibrate.param_bytes(args), "adamw") in seen  # after the optimizer's step
    assert got[syncprobe.ZERO1] == {"builtin": {"x": 1}}
    seen.clear()
    calibrate.probe_in_training(4, ["ddp"], 1 << 20, calibrate.full_bucket_bytes(args), calibrate.param_bytes(args))
    assert [c for c, *_ in seen] == ["all_reduce"]  # no zero1 compared: no broadcasts probed


def _probe_with_slow_buffers(rank, world):
    import time

    real = syncprobe.fsdp_buffers

    def slow(*a, **kw):
        time.sleep(0.2)
        return real(*a, **kw)

    syncprobe.fsdp_buffers = slow
    calls = syncprobe.probe_rank(rank, world, [("reduce_scatter", "shm", 1 << 16)], matmuls=1, reps=4)[0]
    return min(end - start for start, end, _work in calls)  # every call would hold the 0.2 s if it were timed


def test_the_probe_times_the_call_not_the_making_of_its_buffers():
    """FSDP2 writes a reduce-scatter's input (its gradients) before the call: a probe that
    made and wrote its input inside the timed call read gloo's and shm's reduce-scatters
    well above training's (docs/measurements.md, "What the tests rest on")."""
    from commlab.measure import pools

    outcomes = pools.run_once(2, _probe_with_slow_buffers, backend="gloo", timeout=60)
    assert not pools.report_failures(outcomes)
    # 0.1 s: far above a 64 KiB call's time even on loaded cores (the max of four, with the first call's set-up,
    # read 42 ms once with 40 the bound), far below the 0.2 s spent making buffers.
    assert max(o.result for o in outcomes.values()) < 0.1
