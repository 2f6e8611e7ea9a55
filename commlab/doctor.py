"""`python -m commlab.doctor`: the entry point; the code lives in commlab/diagnostics/doctor.py."""
import sys

from commlab.diagnostics.doctor import main

if __name__ == "__main__":
    sys.exit(main())
