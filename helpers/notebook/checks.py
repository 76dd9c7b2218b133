"""Claims as checks: every sentence a notebook states about how a measurement comes out is printed as a check line
right after the measurement, so nbval compares the verdict and a regen that makes the claim false fails.

A check line reads ``[check] <claim>: True`` and is phrased so that True is the expected outcome; a False anywhere
means the prose above it is wrong on that machine. Where the measured value varies by machine, it follows the
verdict in parentheses, ``(measured: 1.62x)``, which ``tests/nbval_sanitize.cfg`` masks: nbval compares the verdict,
the reader still sees the number.

Example (a notebook cell)::

    claim("2 ranks run at least 0.9x the samples/s of 1 rank", ratio >= 0.9, measured=f"{ratio:.2f}x")
    # [check] 2 ranks run at least 0.9x the samples/s of 1 rank: True   (measured: 1.62x)
"""
from __future__ import annotations

import re
from dataclasses import dataclass

PREFIX = "[check] "
LINE = re.compile(r"^\[check\] (?P<claim>.*): (?P<verdict>True|False)(?:\s+\(measured: .*\))?\s*$")


def claim(text: str, holds, *, measured: str | None = None) -> None:
    """Print one check line for ``text`` with the verdict ``bool(holds)`` (and the measured value, if given).

    It returns nothing, so a claim on a cell's last line adds no ``True`` echo under its check line."""
    verdict = bool(holds)
    line = f"{PREFIX}{text}: {verdict}"
    if measured is not None:
        line += f"   (measured: {measured})"
    print(line, flush=True)


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
    return [(m["claim"], m["verdict"] == "True") for m in map(LINE.match, text.splitlines()) if m]


def check_lines(nb) -> list[tuple[str, bool]]:
    """(claim, verdict) of every check line in the stream outputs of a notebook (an ``nbformat`` node)."""
    return [found for cell in nb.cells if cell.cell_type == "code" for out in cell.get("outputs", [])
            if out.get("output_type") == "stream" for found in parse("".join(out.get("text", "")))]


def tally(nb) -> Tally:
    """How many of a notebook's checks printed True, and which printed False."""
    lines = check_lines(nb)
    return Tally(passed=sum(ok for _, ok in lines), failed=[c for c, ok in lines if not ok])
