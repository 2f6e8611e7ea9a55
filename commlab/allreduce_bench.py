"""`python -m commlab.allreduce_bench`: the entry point; the code lives in commlab/measure/bench.py."""
from commlab.core.cli import run
from commlab.measure.bench import main

if __name__ == "__main__":
    run(main)
