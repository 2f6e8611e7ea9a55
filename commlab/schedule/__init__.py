"""Algorithms as data: collective schedules that are checked before they run, priced
from their own steps, run on CPU ranks, and read and written as MSCCL's XML.

    s = commlab.schedule.load("ring.xml")    # MSCCL XML
    commlab.schedule.check(s)                # ScheduleError naming rank, threadblock, step
    commlab.all_reduce(t, algorithm="msccl:ring.xml")
"""
from .check import ScheduleError, Summary, Violation, check, violations
from .ir import KINDS, Block, Rank, Schedule, Step
from .lower import unfused
from .msccl import ScheduleFormatError, dumps, load, loads, save

__all__ = ["Schedule", "Rank", "Block", "Step", "KINDS", "load", "loads", "save", "dumps", "check",
           "violations", "Violation", "Summary", "ScheduleError", "ScheduleFormatError", "unfused"]
