"""A job that breaks the CommState rule (tests/test_hooks.py runs it under torchrun):
rank 0 creates a second state that rank 1 never creates, while rank 1 trains with the
first and waits on rank 0 in its first bucket. Each rank writes what it raised, and
when, to OUT/rank<r>.json."""
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import commlab.hooks as hooks

out = sys.argv[1]
dist.init_process_group("gloo")
rank = dist.get_rank()
state = hooks.CommState("ring")
torch.manual_seed(0)
model = DDP(nn.Linear(16, 4))
hooks.register(model, state)
try:
    if rank == 0:
        hooks.CommState("ring")  # against the rule: rank 1 never creates it
    for step in range(3):
        model(torch.randn(8, 16)).sum().backward()
    result = {"type": None}
except BaseException as e:  # noqa: BLE001 - written for the test
    result = {"type": type(e).__name__, "msg": str(e), "t": time.time()}
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(result, f)
os._exit(1 if result["type"] else 0)  # the job is broken either way: no orderly teardown
