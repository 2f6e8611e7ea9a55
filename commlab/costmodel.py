"""`python -m commlab.costmodel`: the entry point; the code lives in commlab/measure/costmodel.py."""
import sys

from commlab.measure.costmodel import main

if __name__ == "__main__":
    sys.exit(main())
