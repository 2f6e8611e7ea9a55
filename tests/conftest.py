import gc
import os

import pytest
import torch
from ranks import RankPool

from commlab.measure import pools

# Many tests' ranks build DDP, whose constructor imports torch._dynamo: once, in the ranks' server,
# which imports it while pytest collects.
pools.preload("torch._dynamo")
pools.warm()

# Small segments and buffers so moderate test sizes exercise the ring's pipelining,
# shared memory's pieces (tensors larger than a buffer) and both shm modes.
RANK_ENV = {
    "COMMLAB_RING_SEGMENT_BYTES": "4096",
    "COMMLAB_SHM_CAPACITY": "16384",
    "COMMLAB_SHM_ONESHOT_MAX": "2048",
}


class Pools:
    def __init__(self):
        self._pools: dict[int, RankPool] = {}

    def get(self, world_size: int) -> RankPool:
        pool = self._pools.get(world_size)
        if pool is None or pool.broken:
            pool = RankPool(world_size, env=RANK_ENV)
            self._pools[world_size] = pool
        return pool

    def run(self, world_size: int, fn, *args, timeout: float = 120.0, **kwargs):
        return self.get(world_size).run(fn, *args, timeout=timeout, **kwargs)

    def close(self):
        for p in self._pools.values():
            p.close()


@pytest.fixture(scope="session", autouse=True)
def private_tmpdir(tmp_path_factory):
    """The processes the tests start keep their temporary files in pytest's own temporary
    directory (removed with its old runs): torchrun leaves a torchelastic_* log directory
    in the system's for every launch and never removes it (some 140 a run of the suite)."""
    old = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(tmp_path_factory.mktemp("tmp"))
    yield os.environ["TMPDIR"]
    if old is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = old


@pytest.fixture(scope="session")
def ranks():
    pools = Pools()
    yield pools
    pools.close()


def pytest_collection_finish(session):
    # torch and the collected tests live as long as the session (commlab.core.cli.run's reason).
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
