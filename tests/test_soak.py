"""Soak: 10,000 mixed-size calls per algorithm on 4 ranks, every result checked
exactly, with no growth in file descriptors, mappings or resident memory."""
import os

import psutil
import pytest
import torch

import commlab

CALLS = int(os.environ.get("COMMLAB_SOAK_CALLS", "10000"))
# Sizes that cross the tests' ring segments (4 KiB), shm's one-shot limit (2 KiB) and
# buffers (16 KiB), and the world size (1 and 3 elements for 4 ranks).
SIZES = [1, 3, 100, 1000, 4096, 5000]


def _fds():
    return len(os.listdir("/proc/self/fd"))


def _maps():
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def soak(rank, p, algorithm, calls):
    bufs = [torch.zeros(n, dtype=torch.int32) for n in SIZES]
    proc = psutil.Process()
    # The backends' allocators and connection buffers grow for the first ~1,000 calls
    # (gloo by ~1.5 MB) and then stay flat: growth counts from the first quarter on.
    settled = calls // 4
    wrong = 0
    for i in range(calls):
        if i == settled:
            fds0, maps0, rss0 = _fds(), _maps(), proc.memory_info().rss
        b = bufs[i % len(bufs)]
        # Different on every rank and every call, so a stale or crossed buffer shows.
        torch.arange(b.numel(), out=b).add_(rank + i % 7)
        commlab.all_reduce(b, algorithm=algorithm)
        want = torch.arange(b.numel(), dtype=torch.int32).mul_(p).add_(p * (i % 7) + sum(range(p)))
        if not torch.equal(b, want):
            wrong += 1
    return {"wrong": wrong, "fds": _fds() - fds0, "maps": _maps() - maps0,
            "rss_growth": proc.memory_info().rss - rss0}


# The p2p algorithms share one transport (transports/p2p.py), soaked at full length by
# ring: the others run 4,000 calls (CI's time budget; growth still counts over 3,000),
# and so does builtin, whose calls are gloo's behind the API every algorithm shares.
SHORT = {"rhd", "rd", "direct", "ps", "ps_sharded", "builtin"}


@pytest.fixture(scope="module")
def soak_ranks():
    """Ranks of the soak's own: the shared pool's ranks carry earlier tests' groups, plans
    and garbage into the measurement (after tests/test_all_gather.py's hundred groups, a
    builtin soak saw ~800 Python objects and a fresh 1 MiB arena appear mid-run, and none
    when run alone)."""
    from conftest import RANK_ENV
    from ranks import RankPool

    pool = RankPool(4, env=RANK_ENV)
    yield pool
    pool.close()


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", commlab.algorithms.for_device("cpu"))
def test_ten_thousand_calls_without_growth(soak_ranks, algorithm):
    calls = min(CALLS, 4000) if algorithm in SHORT else CALLS
    for res in soak_ranks.run(soak, algorithm, calls, timeout=600):
        assert res["wrong"] == 0, res
        assert res["fds"] == 0 and res["maps"] == 0, res
        assert res["rss_growth"] < 2 << 20, res  # over 7,500 calls: > 280 bytes a call
