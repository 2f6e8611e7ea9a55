"""`python -m commlab.predict`: the entry point; the code lives in commlab/training/predict/cli.py."""
import sys

from commlab.training.predict.cli import main

if __name__ == "__main__":
    sys.exit(main())
