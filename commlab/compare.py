"""`python -m commlab.compare`: the entry point; the code lives in commlab/experiments/compare/cli.py."""
import sys

from commlab.experiments.compare.cli import main

if __name__ == "__main__":
    sys.exit(main())
