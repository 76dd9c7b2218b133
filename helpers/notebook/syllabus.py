"""The course's syllabus (``course/syllabus.yml``): its notebooks, their timeouts, budgets and per-profile parameters.

A leaf of ``helpers.notebook``: the runner, the Chinese build and the matrix read it, and it imports none of them.

Example::

    settings, chapters = syllabus()
    select(chapters, ["08", "09"])           # by id, file name or stem
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
SYLLABUS = ROOT / "course" / "syllabus.yml"
BUILD = ROOT / "build"


@dataclass
class Chapter:
    id: str
    file: str
    title: str
    timeout_s: int     # a hang guard: nbval and `make course` stop the notebook past it
    parameters: dict
    budget_s: int = 120  # what the notebook may take in the smoke profile on a 2-core CPU (tests/test_notebooks.py)

    @property
    def path(self) -> Path:
        return NOTEBOOKS / self.file


def syllabus(path: Path = SYLLABUS) -> tuple[dict, list[Chapter]]:
    """(settings, chapters) from the syllabus file."""
    data = yaml.safe_load(path.read_text())
    defaults = data.get("parameters", {})  # per profile, for every notebook; a chapter's own entries win
    chapters = [Chapter(id=str(c["id"]), file=c["file"], title=c["title"], timeout_s=int(c["timeout_s"]),
                        parameters={profile: {**defaults.get(profile, {}), **c.get("parameters", {}).get(profile, {})}
                                    for profile in {*defaults, *c.get("parameters", {})}},
                        budget_s=int(c.get("budget_s", data["budget_s"])))
                for c in data["notebooks"]]
    settings = {k: v for k, v in data.items() if k != "notebooks"}
    return settings, chapters


def select(chapters: list[Chapter], wanted: list[str] | None) -> list[Chapter]:
    if not wanted:
        return chapters
    picked = [c for c in chapters if c.id in wanted or c.file in wanted or Path(c.file).stem in wanted]
    unknown = set(wanted) - {c.id for c in picked} - {c.file for c in picked} - {Path(c.file).stem for c in picked}
    if unknown:
        ids = ", ".join(c.id for c in chapters)
        raise SystemExit(f"unknown notebook(s) {sorted(unknown)}; the syllabus has: {ids}")
    return picked
