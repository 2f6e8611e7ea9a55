"""`python -m commlab.costmodel`: the entry point; the code lives in commlab/measure/costmodel.py."""
from commlab.core.cli import run
from commlab.measure.costmodel import main

if __name__ == "__main__":
    run(main)
