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


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter"])
def test_the_probe_runs_each_family_on_ranks_of_this_machine(collective):
    got = syncprobe.measure(2, collective, "shm", 1 << 16, work_ms=2.0, reps=4)
    assert got["bytes"] == 1 << 16 and got["reps"] == 4
    # Every call ends after every rank arrived; the wait and spread are differences of times.
    assert got["after_us"] > 0 and got["exit_spread_us"] >= 0 and got["wait_us"] >= 0


def test_compare_probes_the_collectives_its_fsdp_modes_call(monkeypatch):
    """--predict this-host probes each all-gather and reduce-scatter algorithm an fsdp mode
    calls (FSDP2's own is gloo's, builtin), once, and nothing for DDP or ZeRO-1."""
    from commlab.training.compare import cli

    seen = []
    monkeypatch.setattr(syncprobe, "measure", lambda world, c, name, nbytes: seen.append((world, c, name)) or {"x": 1})
    got = cli.probe_in_training(4, ["ddp", "zero1", "fsdp", "fsdp:shm", "fsdp:noreshard"])
    assert got == {c: {"builtin": {"x": 1}, "shm": {"x": 1}} for c in ("all_gather", "reduce_scatter")}
    assert sorted(seen) == sorted((4, c, n) for c in ("all_gather", "reduce_scatter") for n in ("builtin", "shm"))
    assert cli.probe_in_training(4, ["ddp", "zero1", "ddp:shm"]) == {}
