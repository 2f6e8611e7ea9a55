"""Is commlab._C linked against the process's shared C++ runtime?

A build whose compiler links libstdc++ statically (a GPU image's /opt/gcc wrapper did:
docs/measurements.md#first-gpu-run-one-h200) carries a private copy of the runtime beside
the one torch loaded: the first C++ error message (TORCH_CHECK's ostream, every
PeerLostError) segfaulted instead of raising. The sign is in the ELF: no libstdc++.so among the libraries it needs. Standalone
(no package imports), so setup.py loads it by path before anything is built."""
from __future__ import annotations

import struct

_SHT_DYNAMIC, _DT_NEEDED = 6, 1


def needed(path: str) -> list[str] | None:
    """The DT_NEEDED entries of a 64-bit little-endian ELF shared object; None when the
    file is not one (another platform: nothing to judge)."""
    with open(path, "rb") as f:
        def read(offset: int, size: int) -> bytes:  # the extension is tens of MB: read only what is asked
            f.seek(offset)
            return f.read(size)

        head = read(0, 64)
        if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
            return None
        shoff, = struct.unpack_from("<Q", head, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", head, 0x3A)
        table = read(shoff, shentsize * shnum)
        sections = [struct.unpack_from("<IIQQQQIIQQ", table, i * shentsize) for i in range(shnum)]
        out = []
        for _, kind, _, _, offset, size, link, _, _, _ in sections:
            if kind != _SHT_DYNAMIC:
                continue
            dynamic = read(offset, size)
            strings = read(sections[link][4], sections[link][5])
            for pos in range(0, len(dynamic) - 15, 16):
                tag, value = struct.unpack_from("<qQ", dynamic, pos)
                if tag == 0:
                    break
                if tag == _DT_NEEDED:
                    out.append(strings[value:strings.index(b"\0", value)].decode())
        return out


def problem(path: str) -> str | None:
    """Why the extension at `path` must not be loaded, or None."""
    libs = needed(path)
    if libs is None or any(n.startswith("libstdc++") for n in libs):
        return None
    return (f"{path} links the C++ runtime statically (it needs {', '.join(libs)}, not libstdc++.so): its first C++ "
            "error would crash the process instead of raising, as torch's runtime is another copy. The compiler "
            "(CXX) links libstdc++ statically; rebuild with one that does not, e.g. "
            "`CC=/usr/bin/gcc CXX=/usr/bin/g++ pip install --no-build-isolation -e .`")
