"""`python -m commlab.compare`: the entry point; the code lives in commlab/training/compare/cli.py."""
import sys

from commlab.training.compare.cli import main

if __name__ == "__main__":
    sys.exit(main())
