"""Per-call time of small family calls (2 ranks, one host), for the point-to-point check bound once per kind of call
(docs/measurements.md): python docs/data/family-check-binding-ab.py 500, alternated with the commit before."""
import sys, time, statistics
import torch
from commlab.measure.pools import RankPool

def body(rank, p, calls):
    import commlab, torch
    res = {}
    for coll, alg in (("all_gather", "ring"), ("reduce_scatter", "ring"), ("broadcast", "binomial"), ("all_gather", "direct")):
        n = 512
        inp = torch.ones(n if coll != "reduce_scatter" else n * p); out = torch.empty(n * p if coll == "all_gather" else n)
        def call():
            if coll == "all_gather": commlab.all_gather(out, inp, algorithm=alg)
            elif coll == "reduce_scatter": commlab.reduce_scatter(out, inp, algorithm=alg)
            else: commlab.broadcast(inp, src=0, algorithm=alg)
        for _ in range(200): call()
        ts = []
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(calls): call()
            ts.append((time.perf_counter() - t) / calls * 1e6)
        res[f"{coll}:{alg}"] = statistics.median(ts)
    return res

if __name__ == "__main__":
    pool = RankPool(2)
    try:
        r = pool.run(body, int(sys.argv[1]) if len(sys.argv) > 1 else 1000, timeout=600)
        print({k: round(v, 1) for k, v in r[0].items()})
    finally:
        pool.close()
