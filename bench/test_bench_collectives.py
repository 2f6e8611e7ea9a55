"""pytest bench/ --benchmark-only: every algorithm of every collective (all-reduce,
all-gather, reduce-scatter, broadcast, all-to-all) x {4 KiB, 1 MiB, 16 MiB} on a
persistent 4-rank gloo group; busbw (nccl-tests definition) in extra_info. What a call's
buffers are and what it must leave on every rank come from the collective's spec
(commlab/measure/specs.py): nothing here branches on a collective's name."""
import pytest

from commlab import algorithms

SIZES = {"4K": 4 << 10, "1M": 1 << 20, "16M": 16 << 20}
ROUNDS = {"4K": 40, "1M": 15, "16M": 4}
CASES = [(c, a) for c in algorithms.COLLECTIVES for a in algorithms.registry(c).for_device("cpu")]


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("collective,algorithm", CASES, ids=[f"{c}-{a}" for c, a in CASES])
def test_collective(benchmark, bench_group, collective, algorithm, size):
    rounds, warmup = ROUNDS[size], 2
    # A disabled benchmark (--benchmark-disable, the CI smoke) calls the target once.
    calls = bench_group.prepare(collective, algorithm, SIZES[size], 1 if benchmark.disabled else rounds + warmup)
    benchmark.group = f"{collective} {size}"
    benchmark.pedantic(calls, rounds=rounds, iterations=1, warmup_rounds=warmup)
    assert calls.wrong() == 0, (collective, algorithm, size)
    if benchmark.disabled:
        return
    p = bench_group.world_size
    algbw = calls.bytes / benchmark.stats.stats.median / 1e9
    benchmark.extra_info.update(world_size=p, bytes=calls.bytes, algbw_gbps=algbw,
                                busbw_gbps=algbw * algorithms.registry(collective).busbw_factor(p))
