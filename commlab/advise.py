"""`python -m commlab.advise`: the entry point; the code lives in commlab/diagnostics/advise.py."""
import sys

from commlab.diagnostics.advise import main

if __name__ == "__main__":
    sys.exit(main())
