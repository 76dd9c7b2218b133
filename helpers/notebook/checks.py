"""Claims as checks: every sentence a notebook states about how a measurement comes out is printed as a check line
right after the measurement, so nbval compares the verdict and a regen that makes the claim false fails.

A check line reads ``[check] <claim>: True`` and is phrased so that True is the expected outcome; a False anywhere
means the prose above it is wrong on that machine. Where the measured value varies by machine, it follows the
verdict in parentheses, ``(measured: 1.62x)``, which ``tests/nbval_sanitize.cfg`` masks: nbval compares the verdict,
the reader still sees the number.

In the Chinese edition a check line reads ``[检查] <论断>：True（实测：1.62x）``. Its sentence comes from
``translations/zh_CN/checks.po``, whose msgids are the English sentences with each number replaced by a numbered
field (:func:`template`: ``2 ranks run at least 0.9x`` is ``{0} ranks run at least {1}x``), so one translation
serves every rank count. The Chinese build (:mod:`helpers.notebook.translate`) renders the English notebook's saved
lines that way, and a claim printed by a notebook run from ``notebooks/zh/`` prints in Chinese too; the English
notebooks and what nbval compares are unchanged.

Example (a notebook cell)::

    claim("2 ranks run at least 0.9x the samples/s of 1 rank", ratio >= 0.9, measured=f"{ratio:.2f}x")
    # [check] 2 ranks run at least 0.9x the samples/s of 1 rank: True   (measured: 1.62x)
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from . import i18n
# a sentence's numbers as fields (its catalogue msgid) and back live in i18n (which the exercises use too)
from .i18n import FIELD, NUMBER, fill_numbers as fill, number_template as template  # noqa: F401

PREFIX = "[check] "
LINE = re.compile(r"^\[check\] (?P<claim>.*): (?P<verdict>True|False)(?:\s+\(measured: (?P<measured>.*)\))?\s*$")
ZH_LINE = re.compile(r"^\[检查\] (?P<claim>.*)：(?P<verdict>True|False)(?:（实测：(?P<measured>.*)）)?\s*$")
def line(text: str, verdict: bool, measured: str | None = None, lang: str | None = None) -> str:
    """The check line for ``text`` in ``lang`` (default: the notebook's language,
    :func:`helpers.notebook.i18n.language`); English where the Chinese catalogue has no translation of the sentence."""
    lang = i18n.normalise(lang) if lang else i18n.language()
    if lang != i18n.ENGLISH:
        msgid, numbers = template(text)
        translated = i18n.catalogue(lang, i18n.CHECKS_DOMAIN).get(msgid)
        if translated:
            return f"[检查] {fill(translated, numbers)}：{verdict}" + (f"（实测：{measured}）" if measured is not None
                                                                      else "")
    out = f"{PREFIX}{text}: {verdict}"
    return out + (f"   (measured: {measured})" if measured is not None else "")


def localize(text: str, lang: str) -> str:
    """A saved output's text with every English check line in it shown in ``lang`` (other lines as they are)."""
    out = []
    for row in text.split("\n"):
        m = LINE.match(row)
        out.append(line(m["claim"], m["verdict"] == "True", m["measured"], lang) if m else row)
    return "\n".join(out)


def claim(text: str, holds, *, measured: str | None = None) -> None:
    """Print one check line for ``text`` with the verdict ``bool(holds)`` (and the measured value, if given).

    It returns nothing, so a claim on a cell's last line adds no ``True`` echo under its check line."""
    print(line(text, bool(holds), measured), flush=True)


@dataclass(frozen=True)
class Tally:
    """The check lines of one executed notebook."""

    passed: int
    failed: list[str]  # the claims that printed False

    @property
    def total(self) -> int:
        return self.passed + len(self.failed)

    def __str__(self) -> str:
        return f"{self.passed}/{self.total}"


def parse(text: str) -> list[tuple[str, bool]]:
    """(claim, verdict) of every check line in ``text``, in order (what a cell printed; tests read it from capsys)."""
    return [(m["claim"], m["verdict"] == "True") for m in map(_match, text.splitlines()) if m]


def _match(row: str):
    return LINE.match(row) or ZH_LINE.match(row)


def check_lines(nb) -> list[tuple[str, bool]]:
    """(claim, verdict) of every check line in the stream outputs of a notebook (an ``nbformat`` node)."""
    return [found for cell in nb.cells if cell.cell_type == "code" for out in cell.get("outputs", [])
            if out.get("output_type") == "stream" for found in parse("".join(out.get("text", "")))]


def tally(nb) -> Tally:
    """How many of a notebook's checks printed True, and which printed False."""
    lines = check_lines(nb)
    return Tally(passed=sum(ok for _, ok in lines), failed=[c for c, ok in lines if not ok])
