"""All-reduce of CUDA tensors on one host without NCCL: CUDA IPC one-/two-shot kernels
when every GPU can read every other's memory, host-staged shared memory otherwise
(GPUs without P2P, or several processes on one GPU)."""
from commlab.core import ext
from commlab.transports import ipc

from ..base import Algorithm, Cost


class CudaIpc(Algorithm):
    name = "ipc"
    summary = "CUDA IPC on one host: P2P one-/two-shot kernels, or staged through host shared memory"
    formula = ("p2p one-shot: α + (p-1)·n·β(peer reads) + (p-1)·nγ;  two-shot: 2α + 2(p-1)/p·n·β + (p-1)/p·nγ; "
               "staged: + 2n over PCIe (copy to and from host) + shm's cost")
    wins_when = "GPUs of one host with NVLink/PCIe P2P and small to medium messages (latency-bound)"
    devices = ("cuda",)
    order = 80
    level = "ipc"
    mode = ipc.Mode.AUTO  # one-shot up to COMMLAB_IPC_ONESHOT_MAX, two-shot above

    def cost(self, p, nbytes):
        if nbytes <= ipc.ONESHOT_MAX:
            return Cost(1, (p - 1) * nbytes, (p - 1) * nbytes)
        return Cost(2, 2 * (p - 1) / p * nbytes, (p - 1) / p * nbytes)

    def unsupported(self, tensor, op, info):
        if ext.C is None:
            return f"commlab._C is not usable ({ext.IMPORT_ERROR})"
        if not ext.HAS_CUDA:
            return "commlab._C was built without CUDA kernels (no CUDA toolkit at build time, or COMMLAB_NO_CUDA=1)"
        return None

    def checks_calls(self, ctx):
        return True  # each rank's call record is compared after the first barrier

    def run(self, buf, op, ctx):
        ipc.all_reduce(buf, ctx.recorded(op), self.mode, ctx.info, self.name)


ALGORITHM = CudaIpc()
