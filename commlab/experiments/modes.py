"""A training mode's name, read once: what compare runs and predict prices.

    dp                  nn.DataParallel (one process, device 0 gathers and scatters)
    ddp                 DistributedDataParallel with its own all-reduce
    ddp:<algorithm>     DDP with commlab's <algorithm> as its communication hook
    ddp:noop            DDP with no communication (the compute-only floor)
    ddp@<backend>       DDP's own all-reduce on the process group of <backend> (ddp@commlab)
    zero1               DDP + ZeroRedundancyOptimizer (optimizer state sharded)
    fsdp                FSDP2 with torch's collectives
    fsdp:noreshard      FSDP2 keeping parameters gathered from forward into backward
    fsdp:<algorithm>    FSDP2 with commlab's <algorithm> all-gathers and reduce-scatters
"""
from __future__ import annotations

from dataclasses import dataclass

KINDS = ("dp", "ddp", "zero1", "fsdp")


@dataclass(frozen=True)
class Mode:
    name: str  # as the user wrote it, and as rows and reports name it
    kind: str  # one of KINDS; "" for a name that is none of them
    algorithm: str | None = None  # commlab's algorithm in the mode's name (ddp:ring, fsdp:shm)
    backend: str | None = None  # ddp@<backend>: DDP's own reduction on that process group
    noop: bool = False  # ddp:noop
    reshard: bool = True  # False for fsdp:noreshard

    @staticmethod
    def parse(name: str) -> Mode:
        kind, sep, rest = name.partition("@")
        if sep:
            return Mode(name, "ddp" if kind == "ddp" and rest else "", backend=rest or None)
        kind, sep, rest = name.partition(":")
        if kind not in KINDS or (sep and not rest) or (sep and kind in ("dp", "zero1")):
            return Mode(name, "")
        if kind == "ddp" and rest == "noop":
            return Mode(name, kind, noop=True)
        if kind == "fsdp" and rest == "noreshard":
            return Mode(name, kind, reshard=False)
        return Mode(name, kind, algorithm=rest or None)

    @property
    def sharded(self) -> bool:
        """ZeRO-1's and FSDP's modes: the ones whose ranks hold a shard of the training state."""
        return self.kind in ("zero1", "fsdp")

    @property
    def all_reduce(self) -> str | None:
        """The all-reduce carrying a DDP-bucketed mode's gradients: builtin where it is torch's
        own (ddp, ddp@<backend>, zero1), None where nothing is reduced (ddp:noop) or DDP's
        buckets are not used (dp, fsdp)."""
        if self.kind == "zero1" or (self.kind == "ddp" and not self.noop):
            return self.algorithm or "builtin"
        return None

    @property
    def collectives(self) -> str:
        """FSDP's all-gather / reduce-scatter algorithm (builtin: FSDP2's own)."""
        return self.algorithm or "builtin"

