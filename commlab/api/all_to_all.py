"""commlab.all_to_all: torch.distributed.all_to_all_single's contract over any registered
all-to-all algorithm."""
from __future__ import annotations

import operator

import torch

from commlab.algorithms import all_to_all as family_
from commlab.algorithms.all_to_all.base import Counts
from commlab.api import family
from commlab.transports.records import CallRecord


def all_to_all(output, input, output_split_sizes=None, input_split_sizes=None, group=None, *,
               algorithm: str = "pairwise", async_op: bool = False):
    """Split `input` along dim 0 into one block per rank (`input_split_sizes`, or evenly),
    send block q to rank q, and leave the block from each rank j in `output` (along dim 0,
    `output_split_sizes` or evenly, rank order), with the named algorithm.

    torch.distributed.all_to_all_single's contract: split sizes count rows of dim 0, any
    shape, layout and dtype, uneven splits and empty blocks; input and output are separate
    tensors; every rank's counts must match its peers' (rank j's input block for q is
    rank q's output block from j) or every rank raises the same CollectiveMismatchError
    before any byte lands; with async_op=True returns a handle with wait(),
    is_completed() and get_future()."""
    if (not async_op and output_split_sizes is None and input_split_sizes is None  # even splits, plain tensors
            and type(output) is torch.Tensor and type(input) is torch.Tensor):
        plan = family.fast_plan(("all_to_all", algorithm, id(group)))
        if plan is not None and family.run_fast(plan, output, input):
            return None
    plan = _plans.plan(algorithm, group, input, output, input)
    counts = _counts(plan, output, input, output_split_sizes, input_split_sizes)
    return family.run(plan, output, input, async_op, extra=counts)


def _counts(plan, out, inp, out_splits, in_splits) -> Counts:
    """This rank's counts in elements, from rows of dim 0; refused (every peer told) when
    they cannot describe its own tensors."""
    p = plan.info.size
    send = _per_rank(plan, inp, in_splits, "input", p)
    recv = _per_rank(plan, out, out_splits, "output", p)
    if p == 1 and send != recv:
        plan.refuse(f"of one rank sends {send[0]} elements to itself and expects {recv[0]}")
    return Counts(send, recv)


def _per_rank(plan, t: torch.Tensor, splits, role: str, p: int) -> list[int]:
    if t.dim() == 0:
        plan.refuse(f"{role} needs at least one dimension: blocks are rows of dim 0")
    rows = t.shape[0]
    row = t.numel() // rows if rows else 0
    if splits is None or len(splits) == 0:  # torch's c10d passes an empty list for even splits
        if rows % p:
            plan.refuse(f"{role}'s dim 0 ({rows} rows) does not divide evenly among {p} ranks")
        return [rows // p * row] * p
    try:  # ints of any kind (numpy's, 0-dim tensors' .item() aside), never bools or floats
        sizes = [operator.index(s) for s in splits if not isinstance(s, bool)]
    except TypeError:
        sizes = []
    if len(sizes) != p or len(sizes) != len(list(splits)) or min(sizes) < 0:
        plan.refuse(f"{role}_split_sizes must be {p} non-negative ints (one per rank), got {list(splits)}")
    if sum(sizes) != rows:
        plan.refuse(f"{role}_split_sizes add up to {sum(sizes)} rows, the {role} has {rows}")
    return [s * row for s in sizes]


class _Plan(family.Plan):
    collective = "all_to_all"

    def sizes(self, out, inp, p):
        return None  # the counts, checked by _counts before the call is run

    def empty(self, out, inp):
        return False  # peers may send this rank nothing and still exchange among themselves

    def record(self, out, inp, root, counts):
        return CallRecord(self.collective, 0, inp.dtype, None, self.alg.name, splits=(counts.send, counts.recv))

    def body(self, out, inp, root, counts):
        if counts.matrix is not None and not bool(counts.matrix.any()):
            return  # agreed: no rank sends anything
        flat_in = inp.resolve_conj().resolve_neg()
        flat_in = flat_in.reshape(-1) if flat_in.is_contiguous() else flat_in.contiguous().view(-1)
        # A private result when out is strided, a conj/neg view, or shares memory with the input.
        own = out.is_contiguous() and not out.is_conj() and not out.is_neg() and not family.overlaps(out, flat_in)
        result = out.view(-1) if own else torch.empty(out.numel(), dtype=out.dtype, device=out.device)
        if self.info.size == 1:
            result.copy_(flat_in)
        else:  # a rank with nothing of its own still takes part: Bruck relays its peers' blocks
            self.alg.run(result, flat_in, counts, self.ctx)
        if not own:
            out.copy_(result.view(out.shape))


_plans = family.Plans(_Plan, family_)
