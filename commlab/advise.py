"""`python -m commlab.advise`: the entry point; the code lives in commlab/diagnostics/advise.py."""
from commlab.core.cli import run
from commlab.diagnostics.advise import main

if __name__ == "__main__":
    run(main)
