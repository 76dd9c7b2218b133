"""Course scripts in a lesson: shown whole with their lesson lines marked, as a diff against the previous lesson's
script, or just the lines a lesson points at, found by markers that must each match.

A lesson cell shows the lines of ``course/<script>`` that carry its lesson (the DDP wrap, the sampler, the save)
instead of making the learner scroll the whole file. A marker that matches no code line is an error, never a
silently shorter listing: scripts change, and a lesson that describes a line the listing no longer shows is wrong.

Example::

    from helpers.notebook.scripts import show_diff, show_lesson_lines, show_script
    show_lesson_lines("ddp_cifar10.py", ["init_process_group(", "DDP("])
    show_script("ddp_cifar10.py", ["DDP("])     # the whole script, the lesson lines highlighted
    show_diff("ddp_tuning.py", "ds_tuning.py")  # what the next framework changes
"""
from __future__ import annotations

from pathlib import Path

COURSE = Path(__file__).resolve().parents[2] / "course"
MARK = "#fff3b0"  # the background of a lesson line


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


def _code_lines(script: str) -> list[str]:
    """The lines of ``course/<script>`` after its module docstring: what a diff between two lessons compares."""
    text = (COURSE / script).read_text()
    if text.lstrip().startswith('"""'):
        text = text.split('"""', 2)[2].lstrip("\n")
    return text.splitlines()


class Listing:
    """A course script or a diff, shown in a notebook: highlighted HTML (Pygments) with the lesson lines marked, and
    a plain-text form (``>`` in the gutter of a lesson line; the diff's ``+``/``-``) that nbval compares."""

    def __init__(self, title: str, lines: list[str], lexer: str, marked: set[int] = frozenset(), numbered=True):
        self.title, self.lines, self.lexer, self.marked, self.numbered = title, lines, lexer, set(marked), numbered

    def __repr__(self) -> str:
        if not self.numbered:
            return "\n".join([self.title, *self.lines])
        return "\n".join([self.title] + [f"{'>' if n in self.marked else ' '}{n:4d}  {line}"
                                         for n, line in enumerate(self.lines, 1)])

    def _repr_html_(self) -> str:
        from html import escape

        from pygments import highlight
        from pygments.formatters import HtmlFormatter
        from pygments.lexers import get_lexer_by_name
        from pygments.styles import get_style_by_name

        class Marked(get_style_by_name("default")):  # inline styles (no CSS in a notebook): the mark colour too
            highlight_color = MARK

        formatter = HtmlFormatter(noclasses=True, style=Marked, linenos="inline" if self.numbered else False,
                                  hl_lines=sorted(self.marked))
        body = highlight("\n".join(self.lines) + "\n", get_lexer_by_name(self.lexer), formatter)
        return f"<p><b>{escape(self.title)}</b></p>{body}"


def show_script(script: str, markers=()) -> Listing:
    """The whole of ``course/<script>`` (the lines :func:`lesson_lines` finds for ``markers`` highlighted), for a
    notebook cell to display. Line numbers are the file's own.

    Example::

        show_script("ddp_cifar10.py", ["init_process_group(", "DDP("])
    """
    marked = {n for n, _ in lesson_lines(script, markers)} if markers else set()
    lines = (COURSE / script).read_text().splitlines()
    return Listing(f"course/{script} ({len(lines)} lines; lesson lines marked)", lines, "python", marked)


def script_diff(old: str, new: str, *, context: int = 1) -> list[str]:
    """The unified diff from ``course/<old>`` to ``course/<new>`` below their docstrings, without the file headers:
    what the next lesson changes. ``context`` lines of unchanged code around each change."""
    import difflib

    return [line for line in difflib.unified_diff(_code_lines(old), _code_lines(new), lineterm="", n=context)
            if not line.startswith(("---", "+++"))]


def show_diff(old: str, new: str, *, context: int = 1) -> Listing:
    """:func:`script_diff` for a notebook cell to display, with the count of lines each side adds.

    Example::

        show_diff("ddp_tuning.py", "ds_tuning.py")
    """
    diff = script_diff(old, new, context=context)
    added = sum(line.startswith("+") for line in diff)
    removed = sum(line.startswith("-") for line in diff)
    return Listing(f"course/{old} -> course/{new}: {removed} lines out, {added} lines in", diff, "diff",
                   numbered=False)
