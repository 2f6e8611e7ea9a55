"""The point-to-point call check's price, interleaved: two groups over the same ranks, one
whose plans bound the check (the default) and one bound with it off (what
COMMLAB_UNSAFE_SKIP_AGREEMENT=1 does, measurement only); calls alternate between them in
blocks of 20, so the machine's drift hits both alike (the bench's runs, one after the
other, moved by 10-25 % between rounds here). Back-to-back: every call timed; isolated:
each call after a one-element call of the same algorithm (the bench's --blocking barrier).
Prints the median call of each, µs, rank 0's view.
The group made first ran 1 MiB calls 100-350 µs apart from the other here, either way:
SWAP=1 makes the unchecked one first. Rows say which was first ("swapped").
Usage: python docs/data/check-price-interleaved.py RANKS BYTES CALLS [ALGORITHMS [SWAP]]"""
import statistics
import sys
import time

import torch
import torch.distributed as dist

import commlab
from commlab.measure.pools import RankPool
from commlab.transports import p2p


def body(rank, p, algorithms, n, nbytes, swap, block=20):
    made = [dist.new_group(), dist.new_group()]  # the group made first runs large messages differently
    groups = {"checked": made[swap], "off": made[1 - swap]}
    x, one = torch.ones(nbytes // 4), torch.ones(1)
    out = {}
    for a in algorithms:
        for m, g in groups.items():
            p2p.UNAGREED = m == "off"  # read when a plan binds its check
            for _ in range(20):
                commlab.all_reduce(x, group=g, algorithm=a)
                commlab.all_reduce(one, group=g, algorithm=a)
        p2p.UNAGREED = False
        for isolated in (False, True):
            for i in range(n):
                m = ("checked", "off")[(i // block) % 2]
                g = groups[m]
                if isolated:
                    commlab.all_reduce(one, group=g, algorithm=a)
                t0 = time.perf_counter()
                commlab.all_reduce(x, group=g, algorithm=a)
                out.setdefault((a, isolated, m), []).append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e6 for k, v in out.items()}


if __name__ == "__main__":
    ranks, nbytes, calls = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    algorithms = (sys.argv[4] if len(sys.argv) > 4 else "ps,ring,rhd,builtin").split(",")
    swap = int(sys.argv[5]) if len(sys.argv) > 5 else 0  # 1: the unchecked group is made first
    res = RankPool(ranks, pg_timeout_s=120).outcomes(body, algorithms, calls, nbytes, swap, timeout=3000)
    o = res[0].result
    if o is None:
        sys.exit(res[0].error[-3000:])
    for isolated in (False, True):
        for a in algorithms:
            on, off = o[(a, isolated, "checked")], o[(a, isolated, "off")]
            print(f"ranks {ranks} bytes {nbytes} {'isolated' if isolated else 'back-to-back'} {a}{' swapped' * swap}: "
                  f"checked {on:.1f} off {off:.1f} diff {on - off:+.1f} ({(on - off) / off * 100:+.1f} %)")
