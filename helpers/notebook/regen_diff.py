"""What a regen changed that a reviewer should read: compared outputs and check lines, not timings and images.

``make regen`` rewrites every output; most of what changes (durations, ports, PIDs, re-encoded plots, cells marked
``nbval-ignore-output``) means nothing. This compares each notebook with its committed version (``git show
HEAD:<path>``) the way nbval does -- text outputs of the compared cells, after the substitutions in
``tests/nbval_sanitize.cfg`` -- and lists what differs, check lines first. A regen with no change to the course
lists nothing but the count of cells whose ignored output or images moved.

    python -m helpers.notebook.regen_diff            # every notebook against HEAD
    python -m helpers.notebook.regen_diff 02 --base HEAD~3
"""
from __future__ import annotations

import argparse
import collections
import configparser
import difflib
import json
import re
import subprocess
import sys
from pathlib import Path

import nbformat

from . import checks
from .runner import ROOT, select, syllabus

SANITIZE = ROOT / "tests" / "nbval_sanitize.cfg"
IGNORE_TAGS = ("nbval-ignore-output", "nbval-skip")


def substitutions(path: Path = SANITIZE) -> list[tuple[re.Pattern, str]]:
    """The (regex, replacement) pairs nbval applies before comparing outputs."""
    cfg = configparser.ConfigParser()
    cfg.read(path)
    return [(re.compile(cfg[s]["regex"]), cfg[s]["replace"]) for s in cfg.sections()]


def _ignored(cell) -> bool:
    """nbval does not compare this cell's output (tagged ``nbval-ignore-output`` or ``nbval-skip``)."""
    return any(t in cell.metadata.get("tags", []) for t in IGNORE_TAGS)


def compared_text(cell, subs) -> str | None:
    """The text nbval compares for a code cell (stream and text/plain outputs, sanitized), None if it is ignored."""
    if cell.cell_type != "code" or _ignored(cell):
        return None
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            parts.append(out.get("text", ""))
        elif "data" in out and "text/plain" in out["data"] and "image/png" not in out["data"]:
            parts.append(out["data"]["text/plain"])
    text = "".join(parts)
    for pattern, replacement in subs:
        text = pattern.sub(replacement, text)
    return text


def changes(old, new, subs) -> dict:
    """``checks`` (check lines added, removed or flipped), ``cells`` (compared cells whose text differs, with a short
    diff) and ``noise`` (cells whose only changes are ones nbval does not compare)."""
    old_checks, new_checks = checks.check_lines(old), checks.check_lines(new)
    out = {"checks": [f"- {c}: {v}" for c, v in old_checks if (c, v) not in new_checks]
                     + [f"+ {c}: {v}" for c, v in new_checks if (c, v) not in old_checks],
           "cells": [], "noise": 0}
    for i, (a, b) in enumerate(zip(old.cells, new.cells)):
        ta, tb = compared_text(a, subs), compared_text(b, subs)
        if ta is not None and tb is not None and ta != tb:
            diff = [l for l in difflib.unified_diff(ta.splitlines(), tb.splitlines(), lineterm="", n=0)
                    if not l.startswith(("---", "+++", "@@"))]
            out["cells"].append((i, diff[:6]))
        elif a.get("outputs") != b.get("outputs"):
            out["noise"] += 1
    if len(old.cells) != len(new.cells):
        out["cells"].append((min(len(old.cells), len(new.cells)), [f"cells: {len(old.cells)} -> {len(new.cells)}"]))
    return out


def _changed_lines(a: str, b: str) -> int:
    return sum(1 for l in difflib.unified_diff(a.splitlines(), b.splitlines(), lineterm="", n=0)
               if l.startswith(("+", "-")) and not l.startswith(("+++", "---")))


def _output_text(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            parts.append(out.get("text", ""))
        for kind, value in out.get("data", {}).items():
            if not kind.startswith("image/"):
                parts.append(value if isinstance(value, str) else json.dumps(value, indent=1, sort_keys=True))
    return "".join(parts)


def _images(cell) -> list[str]:
    return [v for out in cell.get("outputs", []) for k, v in out.get("data", {}).items() if k.startswith("image/")]


def churn(old, new) -> collections.Counter:
    """How much a regen rewrote, the way ``git diff`` would count it, by kind: changed lines of ``source``, of
    ``metadata`` (cells' and the notebook's), of the text in ``compared`` outputs (before nbval's substitutions, so
    a changed timing counts) and in ``ignored`` outputs, and the number of changed ``images``. A regen with no
    change to the course should change no source or metadata, and compared outputs only where nbval masks them."""
    count = collections.Counter()
    dump = lambda m: json.dumps(m, indent=1, sort_keys=True)  # noqa: E731
    count["metadata"] += _changed_lines(dump(old.metadata), dump(new.metadata))
    for a, b in zip(old.cells, new.cells):
        count["source"] += _changed_lines(a.source, b.source)
        count["metadata"] += _changed_lines(dump(a.metadata), dump(b.metadata))
        count["ignored" if _ignored(b) else "compared"] += _changed_lines(_output_text(a), _output_text(b))
        ia, ib = _images(a), _images(b)
        count["images"] += sum(x != y for x, y in zip(ia, ib)) + abs(len(ia) - len(ib))
    for cell in old.cells[len(new.cells):] + new.cells[len(old.cells):]:
        count["source"] += len(cell.source.splitlines())
    return count


def committed(path: Path, base: str):
    rel = path.resolve().relative_to(ROOT)
    text = subprocess.run(["git", "show", f"{base}:{rel}"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return nbformat.reads(text, as_version=4)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", help="ids, file names or stems; default: all")
    parser.add_argument("--base", default="HEAD", help="the git revision to compare with (default HEAD)")
    args = parser.parse_args(argv)
    subs = substitutions()
    _, chapters = syllabus()
    meaningful = 0
    for ch in select(chapters, args.notebooks):
        try:
            old = committed(ch.path, args.base)
        except subprocess.CalledProcessError:
            print(f"{ch.file}: not in {args.base}")
            continue
        new = nbformat.read(ch.path, as_version=4)
        found = changes(old, new, subs)
        meaningful += len(found["checks"]) + len(found["cells"])
        print(f"{ch.file}: {len(found['checks'])} check line(s), {len(found['cells'])} compared cell(s) changed; "
              f"{found['noise']} cell(s) changed only in timings, images or ignored output")
        moved = churn(old, new)
        print("    rewritten: " + ", ".join(f"{moved[k]} {what}" for k, what in (
            ("compared", "lines of compared output (timings included)"), ("ignored", "of ignored output"),
            ("images", "images"), ("metadata", "lines of metadata"), ("source", "of source"))))
        for line in found["checks"]:
            print(f"    check {line}")
        for i, diff in found["cells"]:
            print(f"    cell {i}:")
            for line in diff:
                print(f"      {line[:150]}")
    return 0 if meaningful == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
