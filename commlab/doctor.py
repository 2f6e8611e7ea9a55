"""`python -m commlab.doctor`: the entry point; the code lives in commlab/diagnostics/doctor.py."""
from commlab.core.cli import run
from commlab.diagnostics.doctor import main

if __name__ == "__main__":
    run(main)
