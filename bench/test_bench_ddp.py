"""A DDP training step per communication hook on the persistent 4-rank group.

Side by side in one run: DDP's own allreduce, commlab's overlapped hook, the same
reduction blocking inside the hook, and no communication (the compute floor). The
async/blocking ratio is what overlapping communication with backward buys.
"""
import pytest
from group import BATCH, MODEL

from commlab.experiments import workloads

ROUNDS, WARMUP = 5, 2
CASES = [("ddp", "builtin"), ("noop", "builtin")] + [
    (hook, alg) for alg in ("ring", "shm") for hook in ("async", "blocking")]


@pytest.mark.parametrize("hook,algorithm", CASES, ids=[f"{h}-{a}" for h, a in CASES])
def test_ddp_step(benchmark, bench_group, hook, algorithm):
    calls = 1 if benchmark.disabled else ROUNDS + WARMUP
    step, close = bench_group.prepare_ddp(hook, algorithm, calls)
    benchmark.group = f"ddp step mlp{MODEL['width']}x{MODEL['depth']} batch {BATCH}"
    try:
        benchmark.pedantic(step, rounds=ROUNDS, iterations=1, warmup_rounds=WARMUP)
    finally:
        close()
    if not benchmark.disabled:
        benchmark.extra_info.update(hook=hook, algorithm=algorithm,
                                    grad_mb=workloads.param_bytes(workloads.mlp(**MODEL)) / 2**20)
