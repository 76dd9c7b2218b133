"""Tables and plot labels in the learner's language, for the chapters' lesson modules (notebooks 08, 09 and 10).

A table is a :class:`~helpers.notebook.i18n.Lines`: its headers and notes are :func:`~helpers.notebook.i18n._`
messages, its numbers plain strings formatted as before. :func:`columns` lays a row out the way an f-string such as
``f"{a:>5} {b:>9}"`` does (each cell padded to its width, one space between), so the English table is byte for byte
what the f-string printed, and the Chinese one stays aligned by display width.

Example::

    >>> from helpers.notebook.i18n import _
    >>> spec = ((5, ">"), (9, ">"))
    >>> t = Lines([columns(spec, _("seq"), _("ratio")), columns(spec, "64", "1.000")])
    >>> t.render("en") == f"{'seq':>5} {'ratio':>9}\\n{'64':>5} {'1.000':>9}"
    True
"""
from __future__ import annotations

import functools

from ..i18n import ENGLISH, Cell, Lines, language, localized

__all__ = ["Cell", "Lines", "columns", "line", "show", "label"]


def columns(spec, *texts, sep: str = " ") -> list[Cell]:
    """One row: ``texts[i]`` padded to ``spec[i]`` = (width, align ``<`` or ``>``), ``sep`` between two cells; a
    text past the last spec is appended as it is (a trailing note, a unit)."""
    row: list[Cell] = []
    for i, text in enumerate(texts):
        if i:
            row.append(Cell(sep))
        width, align = spec[i] if i < len(spec) else (None, "<")
        row.append(Cell(text, width, align))
    return row


def line(*texts) -> list[Cell]:
    """A row of unpadded pieces, joined as they are (a note, a sentence with its figures)."""
    return [Cell(t) for t in texts]


def show(lines: Lines) -> None:
    """Show a table in the notebook as a :class:`~helpers.notebook.i18n.Lines` output (the Chinese edition renders
    its words in Chinese), or print it outside one (the same text ``print`` showed before)."""
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:  # pragma: no cover - IPython comes with the course
        get_ipython = None
    if get_ipython is not None and get_ipython() is not None:
        display(lines)
    else:
        print(lines.render(), flush=True)


CJK_FONTS = ("Noto Sans CJK SC", "Noto Sans SC", "Source Han Sans SC", "WenQuanYi Zen Hei", "WenQuanYi Micro Hei",
             "SimHei", "Microsoft YaHei", "PingFang SC", "Heiti SC", "Sarasa Gothic SC")


@functools.lru_cache(maxsize=None)
def cjk_font() -> str | None:
    """The first of :data:`CJK_FONTS` matplotlib can find on this machine, added to its sans-serif list; None if
    there is none (matplotlib's default font has no Chinese glyphs: a label would show empty boxes)."""
    from matplotlib import font_manager, rcParams

    installed = {f.name for f in font_manager.fontManager.ttflist}
    found = next((name for name in CJK_FONTS if name in installed), None)
    if found and found not in rcParams["font.sans-serif"]:
        rcParams["font.sans-serif"] = [found, *rcParams["font.sans-serif"]]
    return found


def label(text) -> str:
    """A plot's label or title (a :func:`~helpers.notebook.i18n._` message) in the kernel's language where
    matplotlib can draw it: in Chinese only with a Chinese font installed (:func:`cjk_font`), else in English."""
    if language() == ENGLISH:
        return str(text)
    return localized(text) if cjk_font() else str(text)
