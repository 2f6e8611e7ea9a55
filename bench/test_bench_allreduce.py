"""pytest bench/ --benchmark-only: each all-reduce, all-gather, reduce-scatter, broadcast and all-to-all algorithm x {4 KiB,
1 MiB, 16 MiB} on a persistent 4-rank gloo group; busbw (nccl-tests definition) in
extra_info."""
import pytest
import torch
from group import wrong_elements, wrong_swapped

import commlab
from commlab.algorithms import Algorithm, for_device

SIZES = {"4K": 4 << 10, "1M": 1 << 20, "16M": 16 << 20}
ROUNDS = {"4K": 40, "1M": 15, "16M": 4}


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("algorithm", for_device("cpu"))
def test_allreduce(benchmark, bench_group, algorithm, size):
    nbytes, rounds = SIZES[size], ROUNDS[size]
    warmup = 2
    # A disabled benchmark (--benchmark-disable, the CI smoke) calls the target once.
    calls = 1 if benchmark.disabled else rounds + warmup
    buf = bench_group.prepare(algorithm, nbytes, calls)
    benchmark.group = f"allreduce {size}"
    benchmark.pedantic(commlab.all_reduce, args=(buf,), kwargs={"algorithm": algorithm},
                       rounds=rounds, iterations=1, warmup_rounds=warmup)
    # The timed calls reduce zeros; one more call on known inputs checks the algorithm
    # (and that every rank made exactly the planned number of calls: a rank out of step
    # would pair this call with a timed one and the sum would differ).
    got = bench_group.check(algorithm, nbytes)
    assert torch.equal(got, torch.full_like(got, bench_group.checked_sum())), (algorithm, size)
    if benchmark.disabled:
        return
    t = benchmark.stats.stats.median
    p = bench_group.world_size
    algbw = buf.numel() * buf.element_size() / t / 1e9
    benchmark.extra_info.update(world_size=p, bytes=buf.numel() * 4, algbw_gbps=algbw,
                                busbw_gbps=algbw * Algorithm.busbw_factor(p))


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("algorithm", commlab.algorithms.registry("all_gather").for_device("cpu"))
def test_all_gather(benchmark, bench_group, algorithm, size):
    nbytes, rounds = SIZES[size], ROUNDS[size]  # nbytes: the gathered output
    warmup = 2
    calls = 1 if benchmark.disabled else rounds + warmup
    inp, out = bench_group.prepare_gather(algorithm, nbytes, calls)
    benchmark.group = f"all_gather {size}"
    benchmark.pedantic(commlab.all_gather, args=(out, inp), kwargs={"algorithm": algorithm},
                       rounds=rounds, iterations=1, warmup_rounds=warmup)
    # One more call, checked: rank r contributed r + 1 (a rank out of step would hang or mismatch).
    out.zero_()
    commlab.all_gather(out, inp, algorithm=algorithm)
    p = bench_group.world_size
    want = torch.arange(1, p + 1, dtype=torch.float32).repeat_interleave(inp.numel())
    assert torch.equal(out, want), (algorithm, size)
    if benchmark.disabled:
        return
    t = benchmark.stats.stats.median
    algbw = out.numel() * out.element_size() / t / 1e9
    benchmark.extra_info.update(world_size=p, bytes=out.numel() * 4, algbw_gbps=algbw,
                                busbw_gbps=algbw * commlab.algorithms.registry("all_gather").busbw_factor(p))


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("algorithm", commlab.algorithms.registry("reduce_scatter").for_device("cpu"))
def test_reduce_scatter(benchmark, bench_group, algorithm, size):
    nbytes, rounds = SIZES[size], ROUNDS[size]  # nbytes: the reduced input
    warmup = 2
    calls = 1 if benchmark.disabled else rounds + warmup
    inp, out = bench_group.prepare_scatter(algorithm, nbytes, calls)
    benchmark.group = f"reduce_scatter {size}"
    benchmark.pedantic(commlab.reduce_scatter, args=(out, inp), kwargs={"algorithm": algorithm},
                       rounds=rounds, iterations=1, warmup_rounds=warmup)
    # One more call, checked: rank r contributed r + 1 everywhere.
    out.zero_()
    commlab.reduce_scatter(out, inp, algorithm=algorithm)
    assert torch.equal(out, torch.full_like(out, bench_group.checked_sum())), (algorithm, size)
    if benchmark.disabled:
        return
    t = benchmark.stats.stats.median
    p = bench_group.world_size
    algbw = inp.numel() * inp.element_size() / t / 1e9
    benchmark.extra_info.update(world_size=p, bytes=inp.numel() * 4, algbw_gbps=algbw,
                                busbw_gbps=algbw * commlab.algorithms.registry("reduce_scatter").busbw_factor(p))


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("algorithm", commlab.algorithms.registry("broadcast").for_device("cpu"))
def test_broadcast(benchmark, bench_group, algorithm, size):
    nbytes, rounds = SIZES[size], ROUNDS[size]  # nbytes: the message
    warmup = 2
    calls = 1 if benchmark.disabled else rounds + warmup
    buf = bench_group.prepare_broadcast(algorithm, nbytes, calls)
    benchmark.group = f"broadcast {size}"
    benchmark.pedantic(commlab.broadcast, args=(buf,), kwargs={"src": 0, "algorithm": algorithm},
                       rounds=rounds, iterations=1, warmup_rounds=warmup)
    # One more call, checked on every rank: rank 0 sends 1.0, the helpers held r + 1.
    commlab.broadcast(buf, src=0, algorithm=algorithm)
    assert wrong_elements(buf) == 0, (algorithm, size)
    if benchmark.disabled:
        return
    t = benchmark.stats.stats.median
    algbw = buf.numel() * buf.element_size() / t / 1e9
    benchmark.extra_info.update(world_size=bench_group.world_size, bytes=buf.numel() * 4, algbw_gbps=algbw,
                                busbw_gbps=algbw * commlab.algorithms.registry("broadcast").busbw_factor(1))


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("algorithm", commlab.algorithms.registry("all_to_all").for_device("cpu"))
def test_all_to_all(benchmark, bench_group, algorithm, size):
    nbytes, rounds = SIZES[size], ROUNDS[size]  # nbytes: each rank's input
    warmup = 2
    calls = 1 if benchmark.disabled else rounds + warmup
    inp, out = bench_group.prepare_all_to_all(algorithm, nbytes, calls)
    benchmark.group = f"all_to_all {size}"
    benchmark.pedantic(commlab.all_to_all, args=(out, inp), kwargs={"algorithm": algorithm},
                       rounds=rounds, iterations=1, warmup_rounds=warmup)
    # One more call, checked on every rank: rank r sends r + 1 in every block.
    out.zero_()
    commlab.all_to_all(out, inp, algorithm=algorithm)
    assert wrong_swapped(out, bench_group.world_size) == 0, (algorithm, size)
    if benchmark.disabled:
        return
    t = benchmark.stats.stats.median
    p = bench_group.world_size
    algbw = inp.numel() * inp.element_size() / t / 1e9
    benchmark.extra_info.update(world_size=p, bytes=inp.numel() * 4, algbw_gbps=algbw,
                                busbw_gbps=algbw * commlab.algorithms.registry("all_to_all").busbw_factor(p))
