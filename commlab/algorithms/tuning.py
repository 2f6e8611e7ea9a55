"""Tuning files: the measured winner per size range, per layout, for `auto` (NCCL's
tuner plugin is the model: a table the library consults per call, written from
measurements, overriding the built-in rule).

`python -m commlab.allreduce_bench ... --tune tuning.json` writes (or updates) the entry
of the layout it ran on; `COMMLAB_TUNING=tuning.json` makes `auto` use it. A layout is
(device type, world size, number of hosts); an entry holds ranges of message sizes,
each with the algorithm that was fastest and correct there, and how it was measured.

    {"commlab_tuning": 1,
     "layouts": [{"device": "cpu", "world_size": 4, "hosts": 1,
                  "ranges": [{"max_bytes": 23170, "algorithm": "shm"},
                             {"max_bytes": null, "algorithm": "builtin"}],
                  "measured": {"command": "...", "timing": "...", "dtype": "float32", "op": "sum", ...}}]}
"""
from __future__ import annotations

import bisect
import hashlib
import json
import math
import os

from commlab.core.errors import UnsupportedError

from .registry import MAKERS

FORMAT = 1
ENV = "COMMLAB_TUNING"


class Table:
    """One layout's ranges: `pick(nbytes)` is the algorithm for a message of that size."""

    def __init__(self, ranges: list[dict], source: str):
        self.bounds = [r["max_bytes"] for r in ranges[:-1]]
        self.names = [r["algorithm"] for r in ranges]
        self.source = source
        self.digest = hashlib.sha256(json.dumps(ranges, sort_keys=True).encode()).hexdigest()[:16]

    def pick(self, nbytes: int) -> str:
        return self.names[bisect.bisect_left(self.bounds, nbytes)]


def path() -> str:
    return os.environ.get(ENV, "")


def _known(name, known: list[str]) -> bool:
    """A registered algorithm other than auto, or a file a maker reads (msccl:PATH: a
    schedule synthesized for this layout, picked for the sizes it was made for)."""
    return isinstance(name, str) and name != "auto" and (name in known or name.partition(":")[0] in MAKERS)


def load(file: str, device: str, world_size: int, hosts: int, known: list[str]) -> Table | None:
    """The table for this layout from `file`, None when the file has no entry for it.
    A file that cannot be read, or names an algorithm that is not registered, raises."""
    try:
        with open(file) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise UnsupportedError(f"commlab[auto]: cannot read the tuning file {ENV}={file}: {e}") from None
    if doc.get("commlab_tuning") != FORMAT:
        raise UnsupportedError(f"commlab[auto]: {file} is not a commlab tuning file (format {FORMAT})")
    for entry in doc.get("layouts", []):
        if (entry.get("device"), entry.get("world_size"), entry.get("hosts")) != (device, world_size, hosts):
            continue
        ranges = entry.get("ranges") or []
        bad = [r.get("algorithm") for r in ranges if not _known(r.get("algorithm"), known)]
        bounds = [r.get("max_bytes") for r in ranges]
        if bad or not ranges or bounds[-1] is not None or any(not isinstance(b, int) for b in bounds[:-1]) \
                or bounds[:-1] != sorted(set(bounds[:-1])):
            raise UnsupportedError(
                f"commlab[auto]: {file}: the {device} entry for {world_size} ranks on {hosts} host(s) is malformed "
                f"(algorithms must be registered or msccl:PATH, and not auto: {bad or 'ok'}; max_bytes must increase "
                "and the last "
                "be null)")
        return Table(ranges, f"{file} ({device}, {world_size} ranks, {hosts} host(s))")
    return None


def winners(results: list[dict], candidates: list[str]) -> list[dict]:
    """Ranges from a bench run: at each measured size the fastest correct candidate;
    neighbouring sizes with one winner merge, and a boundary sits at the geometric mean
    of the two sizes around it."""
    by_size: dict[int, dict] = {}
    for r in results:
        if r["algorithm"] in candidates and r["wrong"] == 0:
            best = by_size.get(r["bytes"])
            if best is None or r["time_us"] < best["time_us"]:
                by_size[r["bytes"]] = r
    sizes = sorted(by_size)
    if not sizes:
        raise ValueError("no correct measurement of a tunable algorithm to tune from")
    ranges: list[dict] = []
    for i, n in enumerate(sizes):
        name = by_size[n]["algorithm"]
        if ranges and ranges[-1]["algorithm"] == name:
            continue
        if ranges:
            ranges[-1]["max_bytes"] = int(math.sqrt(sizes[i - 1] * n))
        ranges.append({"algorithm": name, "max_bytes": None})
    return [{"max_bytes": r["max_bytes"], "algorithm": r["algorithm"]} for r in ranges]


def write(file: str, device: str, world_size: int, hosts: int, ranges: list[dict], measured: dict) -> None:
    """Adds or replaces this layout's entry in `file`, keeping the others."""
    doc = {"commlab_tuning": FORMAT, "layouts": []}
    if os.path.exists(file):
        with open(file) as f:
            doc = json.load(f)
    doc["layouts"] = [e for e in doc.get("layouts", [])
                      if (e.get("device"), e.get("world_size"), e.get("hosts")) != (device, world_size, hosts)]
    doc["layouts"].append({"device": device, "world_size": world_size, "hosts": hosts, "ranges": ranges,
                           "measured": measured})
    doc["layouts"].sort(key=lambda e: (e["device"], e["hosts"], e["world_size"]))
    tmp = f"{file}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2)
    os.replace(tmp, file)
