"""MSCCL's XML, in and out: the format the MSCCL runtime and RCCL load
(rccl src/misc/msccl/msccl_parser.cc). Every attribute rccl reads is required, as
there, but three that msccl-tools' compiler never writes (`outofplace`, `minBytes`,
`maxBytes`: they came with the runtimes' size ranges), which a file may lack: read as
msccl-tools meant them (out of place exactly where not `inplace`, its one flag; no size
range: 0 and 0), named in `Schedule.absent`, and written on save. Attributes rccl ignores
on <algo> (`redop`, `nthreadblocks`, …) are kept and written back, so a file commlab
writes loads and saves to the same bytes."""
from __future__ import annotations

import os
import xml.etree.ElementTree as ET

from commlab.core.errors import CommlabError

from .ir import (
    BUFFERS,
    COLLS,
    KINDS,
    MSCCL_COLL,
    PROTOCOLS,
    Block,
    Rank,
    Schedule,
    Step,
)

ALGO = ("name", "proto", "nchannels", "nchunksperloop", "ngpus", "coll", "inplace", "outofplace",
        "minBytes", "maxBytes")
GPU = ("id", "i_chunks", "o_chunks", "s_chunks")
TB = ("id", "send", "recv", "chan")
# What msccl-tools' MSCCLang compiler does not write (msccl/language/ir.py ir_to_xml), with
# what its absence means (outofplace: the opposite of its one flag, inplace); rccl's parser requires them.
COMPILER_OMITS = {"outofplace": lambda a: 0 if _int(a, "inplace", "<algo>") else 1,
                  "minBytes": lambda a: 0, "maxBytes": lambda a: 0}
STEP = ("s", "type", "srcbuf", "srcoff", "dstbuf", "dstoff", "cnt", "depid", "deps", "hasdep")
ROOT = "root"  # commlab's own <algo> attribute for broadcast (MSCCL ignores it)


class ScheduleFormatError(CommlabError, ValueError):
    """A file that is not an MSCCL schedule commlab can read (the checker's exit 2)."""


def _int(el, attr: str, where: str) -> int:
    text = _attr(el, attr, where).strip()
    body = text.lstrip("+-")
    try:  # as rccl's strtol(s, NULL, 0): 0x hexadecimal, a leading 0 octal
        base = 16 if body[:2].lower() == "0x" else 8 if len(body) > 1 and body[0] == "0" else 10
        return (-1 if text.startswith("-") else 1) * int(body, base)
    except ValueError:
        raise ScheduleFormatError(f"{where}: {attr}={text!r} is not an integer") from None


def _attr(el, attr: str, where: str) -> str:
    value = el.get(attr)
    if value is None:
        raise ScheduleFormatError(f"{where}: attribute {attr!r} missing (MSCCL requires every one)")
    return value


def parse(text: str, source: str = "<string>") -> Schedule:
    try:
        root = ET.fromstring(text)
    except ET.ParseError as e:
        raise ScheduleFormatError(f"{source}: not XML ({e})") from None
    if root.tag != "algo":
        raise ScheduleFormatError(f"{source}: the root element is <{root.tag}>, not <algo>")
    coll = _attr(root, "coll", "<algo>")
    if coll not in COLLS:
        raise ScheduleFormatError(f"{source}: coll={coll!r} is not one commlab runs ({', '.join(COLLS)})")
    proto = _attr(root, "proto", "<algo>")
    if proto not in PROTOCOLS:
        raise ScheduleFormatError(f"{source}: proto={proto!r} is none of {', '.join(PROTOCOLS)}")
    ranks = []
    for g in root.iter("gpu"):
        gid = _int(g, "id", "<gpu>")
        where = f"rank {gid}"
        rank = Rank(gid, _int(g, "i_chunks", where), _int(g, "o_chunks", where), _int(g, "s_chunks", where))
        for t in g.iter("tb"):
            tid = _int(t, "id", f"{where} <tb>")
            tw = f"{where}, threadblock {tid}"
            block = Block(tid, _int(t, "send", tw), _int(t, "recv", tw), _int(t, "chan", tw))
            for k, s in enumerate(t.iter("step")):
                sw = f"{tw}, step {k}"
                if _int(s, "s", sw) != k:
                    raise ScheduleFormatError(f"{sw}: s={s.get('s')} out of document order (MSCCL runs steps in order)")
                typ = _attr(s, "type", sw)
                if typ not in KINDS:
                    raise ScheduleFormatError(f"{sw}: unknown step type {typ!r}")
                bufs = [_attr(s, b, sw) for b in ("srcbuf", "dstbuf")]
                for b in bufs:
                    if b not in BUFFERS:
                        raise ScheduleFormatError(f"{sw}: buffer {b!r} is none of i, o, s")
                hasdep = _int(s, "hasdep", sw)
                if hasdep not in (0, 1):
                    raise ScheduleFormatError(f"{sw}: hasdep={hasdep} (0 or 1)")
                block.steps.append(Step(typ, bufs[0], _int(s, "srcoff", sw), bufs[1], _int(s, "dstoff", sw),
                                        _int(s, "cnt", sw), _int(s, "depid", sw), _int(s, "deps", sw),
                                        bool(hasdep)))
            rank.blocks.append(block)
        ranks.append(rank)
    extra = {k: v for k, v in root.attrib.items() if k not in ALGO and k != ROOT}
    absent = tuple(k for k in COMPILER_OMITS if k not in root.attrib)
    for k in absent:
        root.set(k, str(COMPILER_OMITS[k](root)))
    return Schedule(
        collective=COLLS[coll], ranks=ranks, chunks=_int(root, "nchunksperloop", "<algo>"),
        name=_attr(root, "name", "<algo>"), channels=_int(root, "nchannels", "<algo>"), proto=proto,
        inplace=bool(_int(root, "inplace", "<algo>")), outofplace=bool(_int(root, "outofplace", "<algo>")),
        min_bytes=_int(root, "minBytes", "<algo>"), max_bytes=_int(root, "maxBytes", "<algo>"),
        root=_int(root, ROOT, "<algo>") if ROOT in root.attrib else 0, extra=extra, absent=absent,
    ), _int(root, "ngpus", "<algo>")


def load(path: str | os.PathLike) -> Schedule:
    """Read an MSCCL XML file (ScheduleFormatError when it is not one)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ScheduleFormatError(f"{path}: cannot read ({e})") from None
    return loads(text, str(path))


def loads(text: str, source: str = "<string>") -> Schedule:
    schedule, ngpus = parse(text, source)
    ids = sorted(r.id for r in schedule.ranks)
    if ids != list(range(ngpus)):
        raise ScheduleFormatError(f"{source}: ngpus={ngpus} but <gpu> ids are {ids[:8]}{'…' if len(ids) > 8 else ''}")
    schedule.ranks.sort(key=lambda r: r.id)
    return schedule


def _q(v) -> str:
    return f'"{int(v) if isinstance(v, bool) else v}"'


def dumps(s: Schedule) -> str:
    algo = {"name": s.name, "proto": s.proto, "nchannels": s.channels, "nchunksperloop": s.chunks,
            "ngpus": s.size, "coll": MSCCL_COLL[s.collective], "inplace": s.inplace,
            "outofplace": s.outofplace, "minBytes": s.min_bytes, "maxBytes": s.max_bytes}
    if s.collective == "broadcast":
        algo[ROOT] = s.root
    algo.update(s.extra)
    out = ["<algo " + " ".join(f"{k}={_q(_escape(v))}" for k, v in algo.items()) + ">"]
    for r in s.ranks:
        out.append(f'  <gpu id="{r.id}" i_chunks="{r.i_chunks}" o_chunks="{r.o_chunks}" s_chunks="{r.s_chunks}">')
        for b in r.blocks:
            out.append(f'    <tb id="{b.id}" send="{b.send}" recv="{b.recv}" chan="{b.chan}">')
            for k, st in enumerate(b.steps):
                out.append(
                    f'      <step s="{k}" type="{st.type}" srcbuf="{st.srcbuf}" srcoff="{st.srcoff}" '
                    f'dstbuf="{st.dstbuf}" dstoff="{st.dstoff}" cnt="{st.cnt}" depid="{st.depid}" '
                    f'deps="{st.deps}" hasdep="{int(st.hasdep)}"/>')
            out.append("    </tb>")
        out.append("  </gpu>")
    out.append("</algo>")
    return "\n".join(out) + "\n"


def _escape(v):
    return v.replace("&", "&amp;").replace('"', "&quot;").replace("<", "&lt;") if isinstance(v, str) else v


def save(schedule: Schedule, path: str | os.PathLike) -> None:
    """Write MSCCL XML that rccl's parser reads (attribute order as msccl-tools writes it)."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(dumps(schedule))
