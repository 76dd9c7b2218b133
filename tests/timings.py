"""Where `make test`'s time went: one table from the JUnit XML each tier writes under build/junit/.

    python tests/timings.py            # after `make test` (the Makefile prints it at the end, pass or fail)

Per tier: tests, seconds; then the ten slowest tests of the run and every notebook's seconds under nbval (the sum of
its cells). Read it before adding a test: CI has 90 minutes on 2 cores, and `make test` is held to 35.
"""
from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

JUNIT = Path(__file__).resolve().parents[1] / "build" / "junit"
TIERS = ("fast", "slow", "slurm", "nbval")  # slurm: the SLURM tests, after the slow tier, alone


def read(path: Path) -> list[dict]:
    """Every test case of one JUnit file: its id (file::name), seconds, and outcome."""
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        cls, name = case.get("classname", ""), case.get("name", "")
        cases.append({"id": f"{cls}::{name}" if cls else name, "file": case.get("file") or cls,
                      "seconds": float(case.get("time") or 0), "outcome": outcome})
    return cases


def wall(path: Path) -> float | None:
    """A tier's wall-clock seconds: its test suite's ``time`` (with pytest-xdist less than the sum of its tests,
    which ran side by side); None where the file does not say."""
    suite = next(ET.parse(path).getroot().iter("testsuite"), None)
    return None if suite is None or suite.get("time") is None else float(suite.get("time"))


def notebook_of(case: dict) -> str:
    """nbval names a cell's case after its notebook (classname notebooks.NN_name, or the file attribute)."""
    text = case["file"] or case["id"]
    stem = text.replace("\\", "/").split("/")[-1].split("::")[0]
    return stem.removesuffix(".ipynb").removeprefix("notebooks.") + ".ipynb"


def table(junit: Path = JUNIT) -> str:
    runs = {tier: read(junit / f"{tier}.xml") for tier in TIERS if (junit / f"{tier}.xml").exists()}
    if not runs:
        return f"no JUnit files under {junit}: run `make test` first"
    lines = [f"{'tier':<8}{'tests':>7}{'failed':>8}{'skipped':>9}{'test s':>9}{'wall s':>9}", "-" * 50]
    walls = {}
    for tier, cases in runs.items():
        failed = sum(c["outcome"] in ("failure", "error") for c in cases)
        skipped = sum(c["outcome"] == "skipped" for c in cases)
        summed = sum(c["seconds"] for c in cases)
        walls[tier] = wall(junit / f"{tier}.xml") or summed
        lines.append(f"{tier:<8}{len(cases):>7}{failed:>8}{skipped:>9}{summed:>9.0f}{walls[tier]:>9.0f}")
    total = sum(c["seconds"] for cases in runs.values() for c in cases)
    lines += ["-" * 50, f"{'all':<8}{sum(map(len, runs.values())):>7}{'':>17}{total:>9.0f}{sum(walls.values()):>9.0f}",
              "(test s: the tests' own seconds added up; wall s: the tier's clock, less where xdist ran tests side by "
              "side)", "", "ten slowest tests (fast and slow tiers):"]
    tests = [(c["seconds"], tier, c["id"]) for tier, cases in runs.items() if tier != "nbval" for c in cases]
    for seconds, tier, name in sorted(tests, reverse=True)[:10]:
        lines.append(f"  {seconds:7.1f} s  {tier:<5} {name}")
    if "nbval" in runs:
        per_notebook: dict[str, float] = defaultdict(float)
        for c in runs["nbval"]:
            per_notebook[notebook_of(c)] += c["seconds"]
        lines += ["", "notebooks under nbval:"]
        lines += [f"  {seconds:7.1f} s  {name}" for name, seconds in sorted(per_notebook.items())]
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(Path(sys.argv[1]) if len(sys.argv) > 1 else JUNIT))
