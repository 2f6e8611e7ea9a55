"""Measurement: the all-reduce benchmark harness, timing, the α-β-γ cost model, machine
facts, plots, units, and the one local launcher."""
