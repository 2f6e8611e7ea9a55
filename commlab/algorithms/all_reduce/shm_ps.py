"""Shared memory with one reducer: rank 0 alone reduces every rank's input and the
others copy the result (DataParallel's pattern over shared memory, for the comparison)."""
from commlab.transports import shm

from ..base import Cost, Traffic
from .shm import SharedMemory


class SharedMemoryRoot(SharedMemory):
    name = "shm_ps"
    summary = "shared memory, rank 0 reduces everything (parameter-server pattern)"
    formula = "2α + 2n·β(copy in, copy out) + (p-1)·nγ  (all reduction on the root)"
    wins_when = "never by design: shows a central reducer's cost without network effects"
    order = 70
    mode = shm.Mode.ROOT

    def cost(self, p, nbytes):
        return Cost(2, 2 * nbytes, (p - 1) * nbytes)

    def memory_traffic(self, p, nbytes):
        # The root's: copy in, reduce all p segments into its own, copy out.
        return Traffic(tensor=2 * nbytes, staging=nbytes + (p + 1) * nbytes + nbytes)


ALGORITHM = SharedMemoryRoot()
