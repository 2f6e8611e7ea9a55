"""The fenced code blocks of the README and docs/, as CI and tests/test_docs.py read them
(standard library only: CI reads the README before anything is installed).

A block's info string is its language and then tags, which renderers ignore:
    ```bash                      run with bash, from a scratch folder beside the repository
    ```bash needs=gpu            run where a GPU is (else the test skips, saying so)
    ```bash door                 the README's two commands: CI runs them verbatim (.ci/run)
    ```python torchrun=2         run under torchrun with 2 ranks
    ```python file=PATH          the file at PATH, word for word
    ```text                      output or prose: not code
    ```bash by=tests/X.py        run, verbatim, by that test (which checks more than that it
                                 runs), not a second time by tests/test_docs.py: run_by()
Tags: needs=<gpu|torchvision|matplotlib|mpich|openmpi|root-netns>, timeout=<seconds>.

    python scripts/doc_blocks.py door N      prints the README's N-th door command (1-based)
"""
from __future__ import annotations

import pathlib
import sys
from dataclasses import dataclass, field

ROOT = pathlib.Path(__file__).resolve().parents[1]
LANGUAGES = ("bash", "python", "text")


@dataclass
class Block:
    path: str  # relative to the repository
    line: int  # of the opening fence, 1-based
    lang: str
    tags: dict = field(default_factory=dict)
    code: str = ""

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def blocks(path: pathlib.Path) -> list[Block]:
    out, cur = [], None
    for i, line in enumerate(path.read_text().splitlines(keepends=True), 1):
        if cur is None and line.startswith("```"):
            words = line[3:].split()
            tags = dict(w.split("=", 1) if "=" in w else (w, True) for w in words[1:])
            cur = Block(str(path.relative_to(ROOT)), i, words[0] if words else "", tags)
        elif cur is not None and line.rstrip() == "```":
            out.append(cur)
            cur = None
        elif cur is not None:
            cur.code += line
    if cur is not None:
        raise ValueError(f"{path}:{cur.line}: a code block is never closed")
    return out


def documents() -> list[pathlib.Path]:
    return [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


def all_blocks() -> list[Block]:
    return [b for p in documents() for b in blocks(p)]


def run_by(test: str) -> list[Block]:
    """The blocks a test runs itself (tag by=<its path, from the repository>)."""
    return [b for b in all_blocks() if b.tags.get("by") == test]


def door(n: int) -> str:
    doors = [b for b in blocks(ROOT / "README.md") if b.tags.get("door")]
    return doors[n - 1].code


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "door":
        sys.stdout.write(door(int(sys.argv[2])))
    else:
        sys.exit(__doc__)
