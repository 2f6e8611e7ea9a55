"""A persistent local gloo group for pytest-benchmark: the pytest process is rank 0,
helper ranks are spawned once and follow plans that rank 0 broadcasts.

Each benchmark round is one collective (or one DDP training step) on every rank:
rank 0 broadcasts a plan and then all ranks make exactly `calls` calls in lock-step,
the number pytest-benchmark's pedantic mode will make on rank 0.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from commlab import algorithms
from commlab.core.reduction import Op
from commlab.measure import launch, pools, specs

STOP, COLLECTIVE, DDP_STEP = -1, 0, 1
# How a DDP step communicates: DDP's own allreduce, commlab's overlapped hook, the same
# reduction blocking inside the hook, or no communication at all.
HOOKS = ["ddp", "async", "blocking", "noop"]
MODEL = {"width": 1024, "depth": 3, "in_features": 256}
BATCH = 32
DTYPE = torch.float32


def _plan(values=None) -> list[int]:
    t = torch.tensor(values if values is not None else [0] * 5, dtype=torch.int64)
    dist.broadcast(t, src=0)
    return t.tolist()


class Calls:
    """One collective's benchmark on one rank, read from its spec (commlab/measure/specs.py):
    the timed calls move zeros; one more call on the check's inputs is compared, on every
    rank, with what the spec says it must hold."""

    def __init__(self, collective: str, algorithm: str, nbytes: int, rank: int, p: int):
        self.spec, self.algorithm, self.rank, self.p = specs.SPECS[collective], algorithm, rank, p
        self.count = self.spec.count(nbytes, DTYPE.itemsize, p)
        self.inp = torch.zeros(self.count, dtype=DTYPE)
        self.out = torch.zeros(self.spec.output(self.count, p), dtype=DTYPE) if self.spec.output else None

    def __call__(self) -> None:
        self.spec.run(self.algorithm, self.out, self.inp, Op.SUM)

    @property
    def bytes(self) -> int:
        """nccl-tests' size of the call (the all-reduced buffer, the gathered output, ...)."""
        return self.spec.size(self.count, DTYPE.itemsize, self.p)

    def wrong(self) -> int:
        """The checked call: elements differing from the spec's result, summed over every
        rank (a rank out of step would pair this call with a timed one and differ)."""
        self.inp = specs.check_input(self.rank, self.count, DTYPE, Op.SUM, "cpu")
        if self.out is not None:
            self.out.zero_()
        self()
        got = self.inp if self.out is None else self.out
        want = self.spec.want(self.rank, self.p, self.count, DTYPE, Op.SUM, "cpu")
        wrong = torch.tensor([int((got != want).sum())])
        dist.all_reduce(wrong)
        return int(wrong.item())


def _collective(plan: list[int]) -> tuple[str, str]:
    collective = algorithms.COLLECTIVES[plan[0]]
    return collective, algorithms.registry(collective).for_device("cpu")[plan[1]]


def _helper(rank: int, world_size: int) -> None:
    """Ranks 1..N-1: follow rank 0's plans until it says stop."""
    names = algorithms.for_device("cpu")
    while True:
        kind, *plan = _plan()
        if kind == STOP:
            break
        if kind == COLLECTIVE:
            calls = Calls(*_collective(plan), plan[2], rank, world_size)
            for _ in range(plan[3]):
                calls()
            calls.wrong()
        else:
            _ddp_steps(rank, HOOKS[plan[0]], names[plan[1]], plan[3])


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
    from commlab.experiments import workloads

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


class BenchGroup:
    def __init__(self, world_size: int):
        self.world_size = world_size
        self.names = algorithms.for_device("cpu")
        # commlab's one local launcher: helpers are ranks 1..N-1, this process is rank 0.
        self.pool = pools.RankPool(world_size, spawn=range(1, world_size), pg_timeout_s=120.0)
        self.pool.local_init(0)
        torch.set_num_threads(1)
        self.pool.submit(_helper)

    def prepare(self, collective: str, algorithm: str, nbytes: int, calls: int) -> Calls:
        """Tell the helpers which `calls` come next (and the checked one after them);
        returns rank 0's."""
        _plan([COLLECTIVE, algorithms.COLLECTIVES.index(collective),
               algorithms.registry(collective).for_device("cpu").index(algorithm), nbytes, calls])
        return Calls(collective, algorithm, nbytes, 0, self.world_size)

    def prepare_ddp(self, hook: str, algorithm: str, calls: int):
        """(step, close) for rank 0; the helpers run the same `calls` steps."""
        _plan([DDP_STEP, HOOKS.index(hook), self.names.index(algorithm), 0, calls])
        return ddp_step(0, hook, algorithm)

    def close(self) -> None:
        _plan([STOP, 0, 0, 0, 0])
        self.pool.collect("bench helpers", timeout=60)  # every rank is idle from here
        self.pool.close()
        launch.leave(together=False)
