import pytest
from group import BenchGroup

WORLD_SIZE = 4


@pytest.fixture(scope="session")
def bench_group():
    g = BenchGroup(WORLD_SIZE)
    yield g
    g.close()
