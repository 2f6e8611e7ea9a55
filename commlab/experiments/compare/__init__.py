"""DP vs DDP, measured: `python -m commlab.compare`. cli (arguments, modes), workers (a
DDP rank, the DP process), metrics (what is sampled and how), search (the largest
batch), report (the table and its definitions)."""
