"""Synthesis (commlab.schedule.synthesize): schedules derived from a topology of hosts,
proved by the checker, timed by the simulator against the topology's lower bound, and
exact on CPU ranks like any schedule."""
import pytest
from test_schedule import published_run
from test_tuning import tuned_auto

from commlab import schedule as S
from commlab.algorithms import registry, tuning
from commlab.algorithms.scheduled import AllReduceScheduled
from commlab.schedule import synthesize as Y
from commlab.schedule.topology import Topology, lower_bound, simulate

UNEQUAL = Topology.parse("2,2,1", "1gbit,1gbit,200mbit:50us")
TOPOLOGIES = [Topology.parse("2,2", "1gbit"), UNEQUAL, Topology.parse("3,1", "1gbit,100mbit"),
              Topology.parse("1,1,1,1", "1gbit,1gbit,1gbit,200mbit")]
SKETCHES = [("all_reduce", lambda t: Y.all_reduce(t, rounds=2)[0]), ("all_gather", Y.all_gather),
            ("reduce_scatter", Y.reduce_scatter), ("all_to_all", Y.all_to_all)]


def test_a_slow_hosts_share_of_the_reduction_goes_to_the_fast_hosts():
    assert Y.shares(UNEQUAL) == pytest.approx([0.5, 0.5, 0.0], abs=1e-6)  # closest to 2:2:1 without host 2
    assert Y.shares(Topology.parse("2,2", "1gbit")) == pytest.approx([0.5, 0.5])
    assert Y.shares(Topology.parse("1,1,1,1", "1gbit,1gbit,1gbit,200mbit")) == pytest.approx([1 / 3] * 3 + [0], abs=1e-6)
    assert Y.shares(Topology.parse("4", "1gbit")) == [1.0]


@pytest.mark.parametrize("topo", TOPOLOGIES, ids=lambda t: "+".join(map(str, t.hosts)))
@pytest.mark.parametrize("collective,make", SKETCHES, ids=[c for c, _ in SKETCHES])
def test_every_sketch_is_proved_and_no_schedule_beats_the_lower_bound(topo, collective, make):
    s = make(topo)
    summary = S.check(s)
    n = 16 << 20
    bound, why = lower_bound(collective, topo, n)
    assert "host" in why and bound > 0
    assert simulate(s, summary, topo, n) >= bound * 0.999
    for name in registry(collective).names():  # the bound holds for the built-ins' schedules too
        fixed = registry(collective).get(name).schedule(topo.size)
        if fixed is not None:
            assert simulate(fixed, S.check(fixed), topo, n) >= bound * 0.999, name


def test_the_simulator_times_a_ring_as_its_formula():
    """Two hosts of one rank at 1 Gbit/s: ring all-reduce sends N/2 twice each way, and
    the two directions overlap: N / rate, plus latencies and steps."""
    topo = Topology.parse("1,1", "1gbit:0us", "10gbit:0us", step_us=0)
    ring = registry("all_reduce").get("ring").schedule(2)
    n = 64 << 20
    t = simulate(ring, S.check(ring), topo, n)
    assert t == pytest.approx(n / 125e6, rel=0.03)


def test_on_unequal_links_the_synthesized_all_reduce_beats_the_ring_in_the_model():
    others = {"ring": registry("all_reduce").get("ring").schedule(5)}
    result = Y.synthesize("all_reduce", UNEQUAL, 16 << 20, others)
    times = dict(result.candidates)
    assert result.schedule.name.startswith("synth-all_reduce")
    assert times["ring"] / result.predicted >= 1.3
    assert result.predicted / result.bound <= 1.25
    assert result.solve_s < 60


def test_the_cli_writes_a_proved_schedule_and_says_how_close_it_is(tmp_path, capsys):
    """`python -m commlab.schedule synthesize`, its main run here (the module's own entry
    is the documentation's example, docs/schedules.md)."""
    from commlab.schedule.__main__ import main

    out = tmp_path / "s.xml"
    assert main(["synthesize", "--topology", "2,2,1", "--inter", "1gbit,1gbit,200mbit:50us", "--size", "4M",
                 "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "chose: synth-all_reduce" in printed and "lower bound" in printed and "ratio" in printed
    assert S.check(S.load(out)).ranks == 5
    assert main(["synthesize", "--topology", "2,0", "-o", str(out)]) == 2
    assert "not a topology" in capsys.readouterr().err


def test_a_topology_names_its_links_or_refuses():
    t = Topology.parse("2,2,1", "1gbit,1gbit,200mbit:50us")
    assert [lk.rate for lk in t.links] == [125e6, 125e6, 25e6]
    assert all(lk.latency == pytest.approx(50e-6) for lk in t.links)
    assert t.host_of(4) == 2 and t.ranks_of(1) == [2, 3]
    with pytest.raises(ValueError, match="names 2 links for 3 hosts"):
        Topology.parse("2,2,1", "1gbit,1gbit")


@pytest.mark.slow
def test_synthesized_schedules_give_exact_results_on_cpu_ranks(ranks, tmp_path):
    """Each sketch on 2 + 2 + 1 ranks, every dtype and op of its family, sizes that are
    and are not multiples of its chunks, both executors (msccl:, msccl-shm:)."""
    failures = []
    for collective, make in SKETCHES:
        path = tmp_path / f"{collective}.xml"
        S.save(make(UNEQUAL), path)
        for out in ranks.run(UNEQUAL.size, published_run, str(path), timeout=600):
            failures += out if isinstance(out, list) else [out]
    assert not failures, failures[:5]


def test_auto_picks_a_synthesized_schedule_where_a_tuning_file_names_it(ranks, tmp_path):
    path = tmp_path / "synth.xml"
    S.save(Y.all_reduce(Topology.parse("1,1", "1gbit"), rounds=2)[0], path)
    f = tmp_path / "t.json"
    tuning.write(str(f), "cpu", 2, 1, [{"max_bytes": 1000, "algorithm": "ring"},
                                       {"max_bytes": None, "algorithm": f"msccl:{path}"}], {"command": "test"})
    for got in ranks.run(2, tuned_auto, str(f), AllReduceScheduled, (10, 5000)):
        assert got == {10: ("another", True), 5000: (f"auto->msccl:{path}", True)}, got
