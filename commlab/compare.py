"""`python -m commlab.compare`: the entry point; the code lives in commlab/experiments/compare/cli.py."""
from commlab.core.cli import run
from commlab.experiments.compare.cli import main

if __name__ == "__main__":
    run(main)
