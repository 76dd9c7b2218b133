"""The lines of a course script a lesson points at, found by markers that must each match.

A lesson cell shows the lines of ``course/<script>`` that carry its lesson (the DDP wrap, the sampler, the save)
instead of making the learner scroll the whole file. A marker that matches no code line is an error, never a
silently shorter listing: scripts change, and a lesson that describes a line the listing no longer shows is wrong.

Example::

    from helpers.notebook.scripts import show_lesson_lines
    show_lesson_lines("ddp_cifar10.py", ["init_process_group(", "DDP("])
"""
from __future__ import annotations

from pathlib import Path

COURSE = Path(__file__).resolve().parents[2] / "course"


def lesson_lines(script: str, markers) -> list[tuple[int, str]]:
    """(line number, stripped line) of every code line of ``course/<script>`` containing one of ``markers``, in file
    order; comments and docstring lines never match. Raises ValueError naming each marker that matched nothing."""
    lines = (COURSE / script).read_text().splitlines()
    found, used = [], set()
    for number, line in enumerate(lines, 1):
        if line.lstrip().startswith(("#", '"""')):
            continue
        hits = {m for m in markers if m in line}
        if hits:
            found.append((number, line.strip()))
            used |= hits
    missing = [m for m in markers if m not in used]
    if missing:
        raise ValueError(f"course/{script} has no code line containing {', '.join(map(repr, missing))}: the "
                         f"script changed; update the lesson's markers (and what the lesson says about those lines)")
    return found


def show_lesson_lines(script: str, markers) -> None:
    """Print :func:`lesson_lines` as ``number  line``, the way an editor's gutter shows them."""
    for number, line in lesson_lines(script, markers):
        print(f"{number:4d}  {line}")
