"""A persistent local gloo group for pytest-benchmark: the pytest process is rank 0,
helper ranks are spawned once and follow plans that rank 0 broadcasts.

Each benchmark round is one collective (or one DDP training step) on every rank:
rank 0 broadcasts a plan and then all ranks make exactly `calls` calls in lock-step,
the number pytest-benchmark's pedantic mode will make on rank 0.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from commlab.measure import launch, pools

STOP = -1
ALLREDUCE, DDP_STEP, ALLGATHER, REDUCESCATTER, BROADCAST, ALLTOALL = 0, 1, 2, 3, 4, 5
# How a DDP step communicates: DDP's own allreduce, commlab's overlapped hook, the same
# reduction blocking inside the hook, or no communication at all.
HOOKS = ["ddp", "async", "blocking", "noop"]
MODEL = {"width": 1024, "depth": 3, "in_features": 256}
BATCH = 32


def _plan(values=None) -> list[int]:
    t = torch.tensor(values if values is not None else [0, 0, 0, 0], dtype=torch.int64)
    dist.broadcast(t, src=0)
    return t.tolist()


def _helper(rank: int, world_size: int) -> None:
    """Ranks 1..N-1: follow rank 0's plans until it says stop."""
    import commlab

    names = commlab.algorithms.for_device("cpu")
    gathers = commlab.algorithms.registry("all_gather").for_device("cpu")
    scatters = commlab.algorithms.registry("reduce_scatter").for_device("cpu")
    casts = commlab.algorithms.registry("broadcast").for_device("cpu")
    swaps = commlab.algorithms.registry("all_to_all").for_device("cpu")
    while True:
        kind, a, b, calls = _plan()
        if kind == STOP:
            break
        if kind == ALLGATHER:
            inp, out = gather_buffers(rank, b, world_size)
            for _ in range(calls):
                commlab.all_gather(out, inp, algorithm=gathers[a])
            commlab.all_gather(out, inp, algorithm=gathers[a])  # BenchGroup.check_gather's call
        elif kind == REDUCESCATTER:
            inp, out = scatter_buffers(rank, b, world_size)
            for _ in range(calls + 1):  # the last one: the test's checked call
                commlab.reduce_scatter(out, inp, algorithm=scatters[a])
        elif kind == BROADCAST:
            buf = torch.full((max(b // 4, 1),), float(rank + 1))
            for _ in range(calls + 1):  # the last one: the test's checked call
                commlab.broadcast(buf, src=0, algorithm=casts[a])
            wrong_elements(buf)
        elif kind == ALLTOALL:
            inp, out = swap_buffers(rank, b, world_size)
            for _ in range(calls + 1):  # the last one: the test's checked call
                commlab.all_to_all(out, inp, algorithm=swaps[a])
            wrong_swapped(out, world_size)
        elif kind == ALLREDUCE:
            buf = torch.zeros(max(b // 4, 1), dtype=torch.float32)
            for _ in range(calls):
                commlab.all_reduce(buf, algorithm=names[a])
            commlab.all_reduce(checked_input(rank, b), algorithm=names[a])  # BenchGroup.check's call
        else:
            _ddp_steps(rank, HOOKS[a], names[b], calls)


def _ddp_steps(rank: int, hook: str, algorithm: str, calls: int) -> None:
    # A frame of its own: the model and its hook state die on return, before leave().
    step, close = ddp_step(rank, hook, algorithm)
    for _ in range(calls):
        step()
    close()


def ddp_step(rank: int, hook: str, algorithm: str):
    """A DDP training step on the synthetic MLP; collective to build (same on all ranks)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import commlab.hooks as hooks
    from commlab.training import workloads

    torch.manual_seed(0)
    model = DDP(workloads.mlp(**MODEL), bucket_cap_mb=4)
    state = None
    if hook != "ddp":
        state = hooks.CommState(algorithm)
        fn = {"async": hooks.allreduce_hook, "blocking": hooks.blocking_allreduce_hook, "noop": hooks.noop_hook}[hook]
        hooks.register(model, state, fn)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = workloads.batch(model.module, BATCH, seed=rank)

    def step():
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    def close():
        if state is not None:
            state.close()

    return step, close


def gather_buffers(rank: int, nbytes: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, output) of an all-gather whose output is nbytes (nccl-tests' size); rank r's
    input holds r + 1."""
    n = max(nbytes // 4 // world_size, 1)
    return torch.full((n,), float(rank + 1)), torch.zeros(world_size * n)


def scatter_buffers(rank: int, nbytes: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, output) of a reduce-scatter whose input is nbytes (nccl-tests' size); rank
    r's input holds r + 1, so every output holds the sum of 1..p."""
    n = max(nbytes // 4 // world_size, 1)
    return torch.full((world_size * n,), float(rank + 1)), torch.zeros(n)


def swap_buffers(rank: int, nbytes: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, output) of an all-to-all whose input is nbytes (nccl-tests' size); every
    block rank r sends holds r + 1, so every rank's output holds 1..p block by block."""
    n = max(nbytes // 4 // world_size, 1)
    return torch.full((world_size * n,), float(rank + 1)), torch.zeros(world_size * n)


def wrong_swapped(out: torch.Tensor, world_size: int) -> int:
    """Elements of an all-to-all's output differing from 1..p block by block, summed over every rank."""
    want = torch.arange(1, world_size + 1, dtype=out.dtype).repeat_interleave(out.numel() // world_size)
    wrong = torch.tensor([int((out != want).sum())])
    dist.all_reduce(wrong)
    return int(wrong.item())


def wrong_elements(buf: torch.Tensor) -> int:
    """Elements differing from rank 0's message (1.0), summed over every rank."""
    wrong = torch.tensor([int((buf != 1.0).sum())])
    dist.all_reduce(wrong)
    return int(wrong.item())


def checked_input(rank: int, nbytes: int) -> torch.Tensor:
    return torch.full((max(nbytes // 4, 1),), float(rank + 1), dtype=torch.float32)


class BenchGroup:
    def __init__(self, world_size: int):
        import commlab

        self.world_size = world_size
        self.names = commlab.algorithms.for_device("cpu")
        # commlab's one local launcher: helpers are ranks 1..N-1, this process is rank 0.
        self.pool = pools.RankPool(world_size, spawn=range(1, world_size), pg_timeout_s=120.0)
        self.pool.local_init(0)
        torch.set_num_threads(1)
        self.pool.submit(_helper)

    def prepare(self, algorithm: str, nbytes: int, calls: int) -> torch.Tensor:
        """Tell the helpers what comes next; returns rank 0's buffer."""
        _plan([ALLREDUCE, self.names.index(algorithm), nbytes, calls])
        return torch.zeros(max(nbytes // 4, 1), dtype=torch.float32)

    def check(self, algorithm: str, nbytes: int) -> torch.Tensor:
        """One more call after the timed ones, on inputs whose sum is known (rank r
        contributes r + 1): rank 0's result, to compare with checked_sum()."""
        x = checked_input(0, nbytes)
        import commlab

        commlab.all_reduce(x, algorithm=algorithm)
        return x

    def prepare_gather(self, algorithm: str, nbytes: int, calls: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tell the helpers an all-gather comes next; returns rank 0's (input, output)."""
        import commlab

        _plan([ALLGATHER, commlab.algorithms.registry("all_gather").for_device("cpu").index(algorithm), nbytes, calls])
        return gather_buffers(0, nbytes, self.world_size)

    def prepare_scatter(self, algorithm: str, nbytes: int, calls: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tell the helpers a reduce-scatter comes next; returns rank 0's (input, output)."""
        import commlab

        _plan([REDUCESCATTER, commlab.algorithms.registry("reduce_scatter").for_device("cpu").index(algorithm),
               nbytes, calls])
        return scatter_buffers(0, nbytes, self.world_size)

    def prepare_broadcast(self, algorithm: str, nbytes: int, calls: int) -> torch.Tensor:
        """Tell the helpers a broadcast from rank 0 comes next; returns rank 0's message."""
        import commlab

        _plan([BROADCAST, commlab.algorithms.registry("broadcast").for_device("cpu").index(algorithm), nbytes, calls])
        return torch.full((max(nbytes // 4, 1),), 1.0)

    def prepare_all_to_all(self, algorithm: str, nbytes: int, calls: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tell the helpers an all-to-all comes next; returns rank 0's (input, output)."""
        import commlab

        _plan([ALLTOALL, commlab.algorithms.registry("all_to_all").for_device("cpu").index(algorithm), nbytes, calls])
        return swap_buffers(0, nbytes, self.world_size)

    def checked_sum(self) -> float:
        return float(sum(range(1, self.world_size + 1)))

    def prepare_ddp(self, hook: str, algorithm: str, calls: int):
        """(step, close) for rank 0; the helpers run the same `calls` steps."""
        _plan([DDP_STEP, HOOKS.index(hook), self.names.index(algorithm), calls])
        return ddp_step(0, hook, algorithm)

    def close(self) -> None:
        _plan([STOP, 0, 0, 0])
        self.pool.collect("bench helpers", timeout=60)  # every rank is idle from here
        self.pool.close()
        launch.leave(together=False)
