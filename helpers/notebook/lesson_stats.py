"""How much a learner reads per notebook: words of markdown, lines of code, and the code cells over the limit.

A lesson cell is a launch, a table, a plot or a short snippet (:data:`MAX_CELL_LINES` non-blank lines at most);
claim logic lives in the chapter's module under :mod:`helpers.notebook.lessons`. The parameters cell is not
counted: it is the notebook's settings, read like a config file. ``tests/test_notebooks.py`` holds every chapter to
the limit; ``python -m helpers.notebook.lesson_stats`` prints the table.

Example::

    python -m helpers.notebook.lesson_stats
    # notebook                      words  code lines  code cells  over 12 lines
    # 00_environment_check.ipynb     1210          87          23  -
"""
from __future__ import annotations

import re
from pathlib import Path

import nbformat

MAX_CELL_LINES = 12
# a write-the-code cell (tagged exercise-write) is the learner's own editor: its outline comments, the imports the
# checker saves with the function and the checker call, so it may run longer
MAX_EXERCISE_LINES = 20


def code_lines(cell) -> int:
    """Non-blank lines of a code cell's source."""
    return sum(1 for line in "".join(cell["source"]).splitlines() if line.strip())


def lesson_cells(nb) -> list:
    """The code cells a learner reads: every non-empty code cell but the parameters cell."""
    return [c for c in nb["cells"] if c["cell_type"] == "code" and "".join(c["source"]).strip()
            and "parameters" not in c.get("metadata", {}).get("tags", [])]


def markdown_words(nb) -> int:
    """Whitespace-separated words of every markdown cell (a Chinese cell counts its runs of text, not characters)."""
    return sum(len(re.findall(r"\S+", "".join(c["source"]))) for c in nb["cells"] if c["cell_type"] == "markdown")


def _limit(cell) -> int:
    return MAX_EXERCISE_LINES if "exercise-write" in cell.get("metadata", {}).get("tags", []) else MAX_CELL_LINES


def long_cells(nb) -> list[tuple[str, int]]:
    """(cell id, lines) of every lesson cell over its limit: :data:`MAX_CELL_LINES` non-blank lines, or
    :data:`MAX_EXERCISE_LINES` for a write-the-code cell."""
    return [(c.get("id", "?"), n) for c in lesson_cells(nb) if (n := code_lines(c)) > _limit(c)]


def table(paths) -> str:
    rows = [f"{'notebook':36s} {'words':>6s} {'code lines':>11s} {'code cells':>11s}  over {MAX_CELL_LINES} lines"]
    totals = [0, 0, 0]
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        stats = (markdown_words(nb), sum(map(code_lines, lesson_cells(nb))), len(lesson_cells(nb)))
        totals = [t + s for t, s in zip(totals, stats)]
        over = ", ".join(f"{i} ({n})" for i, n in long_cells(nb)) or "-"
        rows.append(f"{Path(path).name:36s} {stats[0]:6d} {stats[1]:11d} {stats[2]:11d}  {over}")
    rows.append(f"{'total':36s} {totals[0]:6d} {totals[1]:11d} {totals[2]:11d}")
    return "\n".join(rows)


if __name__ == "__main__":
    from .runner import NOTEBOOKS

    print(table(sorted(NOTEBOOKS.glob("[0-9]*.ipynb"))))
