"""`python -m commlab.predict`: the entry point; the code lives in commlab/experiments/predict/cli.py."""
from commlab.core.cli import run
from commlab.experiments.predict.cli import main

if __name__ == "__main__":
    run(main)
