"""The promises the all-gather, reduce-scatter, broadcast and all-to-all families keep
alike, each written once and run for every family: the sweep (every algorithm on 1-5 and
8 ranks), strided layouts and async handles, sub-groups, a rank refusing its own
arguments, a rank failing inside a call, an unknown algorithm, emulated hosts. What each family does is
its own test file's (tests/test_<family>.py), which gives this one: `sweep`, `layouts`,
`subgroups` and `across_hosts` (what its ranks run; `assert_sweep` reads the sweep's
results), `SWEEP` and `ALGORITHMS`, `REFUSAL` (a call one rank refuses, and what every rank
must then say), `FAULTS` (the drills' algorithms and faults), `ACROSS_HOSTS` (the
algorithms run on emulated hosts) and `AUTO_ACROSS_HOSTS` (what auto picks there: by
layout, else the default), `UNKNOWN` (a call of an unknown algorithm). What only one
family promises stays in its file."""
import cases
import pytest
import test_all_gather
import test_all_to_all
import test_broadcast
import test_reduce_scatter

import commlab

FAMILIES = {m.COLLECTIVE: m for m in (test_all_gather, test_reduce_scatter, test_broadcast, test_all_to_all)}


def each_family(cases_of) -> list:
    """pytest parameters (collective, *case) for every family's cases, their marks kept."""
    out = []
    for collective, module in FAMILIES.items():
        for case in cases_of(module):
            values, marks = (case.values, case.marks) if hasattr(case, "marks") else (
                case if isinstance(case, tuple) else (case,), ())
            out.append(pytest.param(collective, *values, marks=marks))
    return out


@pytest.mark.parametrize("collective,world_size,algorithm", each_family(lambda m: m.SWEEP))
def test_sweep(ranks, collective, world_size, algorithm):
    family = FAMILIES[collective]
    family.assert_sweep(ranks.run(world_size, family.sweep, algorithm, timeout=300))


@pytest.mark.parametrize("collective,algorithm", each_family(lambda m: m.ALGORITHMS))
def test_layouts_and_async(ranks, collective, algorithm):
    for fails in ranks.run(3, FAMILIES[collective].layouts, algorithm):
        assert not fails, fails


@pytest.mark.parametrize("collective,algorithm", each_family(lambda m: m.ALGORITHMS))
def test_subgroups(ranks, collective, algorithm):
    assert all(ranks.run(4, FAMILIES[collective].subgroups, algorithm))


@pytest.mark.parametrize("collective,algorithm", each_family(lambda m: m.ALGORITHMS))
def test_a_rank_refusing_its_arguments_makes_every_peer_raise(ranks, collective, algorithm):
    call, text = FAMILIES[collective].REFUSAL
    cases.assert_refusal_named(ranks.run(3, call, algorithm), text)


@pytest.mark.parametrize("collective,algorithm,fault", each_family(lambda m: m.FAULTS))
def test_a_failed_rank_makes_every_peer_raise_within_two_seconds(collective, algorithm, fault):
    cases.assert_drill_named_rank_1(algorithm, fault, collective)


@pytest.mark.parametrize("collective", FAMILIES)
def test_an_unknown_algorithm_is_clear(collective):
    with pytest.raises(commlab.UnsupportedError, match=f"unknown {collective} algorithm 'nope'"):
        FAMILIES[collective].UNKNOWN()


@pytest.mark.parametrize("collective,algorithm", each_family(lambda m: m.ACROSS_HOSTS))
@pytest.mark.parametrize("layout", list(cases.HOST_LAYOUTS))
def test_across_emulated_hosts(ranks, collective, algorithm, layout):
    family = FAMILIES[collective]
    picks = cases.picks_across_hosts(ranks, layout, family.across_hosts, algorithm)
    if algorithm == "auto":  # shm on one host; across hosts as the family's auto decides
        by_layout, otherwise = family.AUTO_ACROSS_HOSTS
        assert picks == {by_layout.get(layout, otherwise)}, picks
