"""What every `python -m commlab.<tool>` does around its main."""
from __future__ import annotations

import gc
import sys
from typing import Callable, NoReturn


def run(main: Callable[[], int | None]) -> NoReturn:
    """sys.exit(main()), with what was imported so far frozen: torch's modules live as long
    as the process, so the collector never walks them again and the interpreter's exit does
    not deallocate them one by one (CPU spent after the work, by every process that ran one)."""
    gc.freeze()
    sys.exit(main())
