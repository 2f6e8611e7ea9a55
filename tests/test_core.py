"""Core pieces tested in one process: the per-group cache."""
import gc
import threading

from commlab.core import groups


class _Group:
    """Stands in for a ProcessGroup: PerGroup only needs identity and weak references."""


def test_per_group_cache_survives_the_collector_inside_make():
    """make() allocates; an allocation may run the garbage collector, which may drop a
    dead group's entry (its weakref.finalize) on this very thread while get() holds the
    cache's lock. Seen as a rank hung in `Garbage-collecting ... groups.py _drop`."""
    released = []
    cache = groups.PerGroup(lambda g: (gc.collect(), object())[1], release=released.append)
    dead = _Group()
    first = cache.get(dead)
    dead.cycle = dead  # dies only when the collector runs
    del dead
    gc.disable()  # nothing else may collect it first
    try:
        done, alive = {}, _Group()
        worker = threading.Thread(target=lambda: done.setdefault("state", cache.get(alive)), daemon=True)
        worker.start()
        worker.join(10)
    finally:
        gc.enable()
    assert "state" in done, "PerGroup.get deadlocked on its own lock inside the collector"
    assert released == [first]
