"""Every notebook at several rank counts: ``make matrix`` (not in ``make test`` or CI: about 1.5 hours on 2 CPU cores).

Each English notebook runs under papermill once per rank count, its ``NPROC`` parameter set to that count, into
``build/matrix/<nproc>/`` (never in place). A notebook whose parameters cell has no ``NPROC`` (06 launches its own
fixed rank counts) runs once, into ``build/matrix/once/``, and the table says so. The check lines are counted from
each executed notebook's outputs by :func:`helpers.notebook.checks.check_lines`, the same counter as ``make course``'s
summary; a check that the committed notebook prints and this run did not is listed as missing (numbers in a claim
count as equal, so "on 3 ranks" answers "on 2 ranks"; a check that the notebook prints only where ``nproc > 1`` is
missing at 1 rank by design). The exit status is 1 when a notebook failed or any check printed False; SLOW (over the
syllabus's smoke timeout, which is set for the default rank count) and missing checks are reported only.

Example::

    python -m helpers.notebook.matrix                      # every notebook at its rank counts (NPROCS below)
    python -m helpers.notebook.matrix 01 02 --nprocs 1 3   # narrowed: make matrix NOTEBOOKS="01 02" NPROCS="1 3"
"""
from __future__ import annotations

import json
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import nbformat

from . import checks, runner
from .runner import BUILD, Chapter

MATRIX = BUILD / "matrix"
ONCE = "once"  # build/matrix/once/: the notebooks that take no NPROC parameter

# The one place for the rank counts of the matrix: every notebook at these...
DEFAULT_NPROCS = (1, 2, 3)
# ...and the sharding chapters also at 4, where a shard is a quarter: DeepSpeed ZeRO (03), DDP against ZeRO (04),
# FSDP2 (07), activation memory (08: DDP over a global batch of 24), tensor parallelism (09: 12 heads split over 1-4),
# pipeline parallelism (10: 12 blocks in 1-4 stages), inside a step (11: its TP run splits 12 heads over 1-4), context
# parallelism (12: 48 positions and 12 heads over 1-4); expert parallelism (13) at the degrees that split 8 experts
NPROCS = {"03": (1, 2, 3, 4), "04": (1, 2, 3, 4), "07": (1, 2, 3, 4), "08": (1, 2, 3, 4), "09": (1, 2, 3, 4),
          "10": (1, 2, 3, 4), "11": (1, 2, 3, 4), "12": (1, 2, 3, 4), "13": (1, 2, 4)}

# papermill injects a parameter under exactly the name it is given (`-p nproc 3` sets a variable `nproc` that the
# notebooks never read, with only a logged warning), so the name is taken from the notebook's own parameters cell
NPROC_NAMES = ("NPROC", "nproc")


@dataclass(frozen=True)
class Run:
    chapter: Chapter
    nproc: int | None  # None: the notebook takes no NPROC parameter and runs once
    parameter: str | None  # the parameters cell's name for it

    @property
    def folder(self) -> str:
        return ONCE if self.nproc is None else str(self.nproc)


def nproc_parameter(path: Path) -> str | None:
    """The name under which the notebook at ``path`` takes its rank count, from its parameters cell; None if it has
    none."""
    import papermill as pm

    names = pm.inspect_notebook(str(path))
    return next((n for n in NPROC_NAMES if n in names), None)


def plan(chapters: list[Chapter], nprocs: list[int] | None = None) -> tuple[list[Run], list[str]]:
    """The runs of the matrix, and a note for each chapter that runs otherwise than asked. ``nprocs`` narrows each
    chapter's rank counts to those it lists (its own counts are :data:`NPROCS`, else :data:`DEFAULT_NPROCS`)."""
    runs, notes = [], []
    for ch in chapters:
        name = nproc_parameter(ch.path)
        if name is None:
            runs.append(Run(ch, None, None))
            notes.append(f"{ch.file}: its parameters cell has no NPROC, so it runs once at its own rank counts")
            continue
        own = NPROCS.get(ch.id, DEFAULT_NPROCS)
        counts = [n for n in own if nprocs is None or n in nprocs]
        if nprocs is not None and set(nprocs) - set(own):
            notes.append(f"{ch.file}: the matrix runs it at {', '.join(map(str, own))} ranks only; "
                         f"not at {', '.join(map(str, sorted(set(nprocs) - set(own))))}")
        runs.extend(Run(ch, n, name) for n in counts)
    return runs, notes


def _same_claim(text: str) -> str:
    return re.sub(r"\d+(?:\.\d+)?", "#", text)


@dataclass(frozen=True)
class Outcome:
    """The check lines of one executed notebook, against those of the committed one."""

    passed: int
    failed: list[str]  # printed False
    missing: list[str]  # printed by the committed notebook, not by this run (the committed notebook's text)

    @property
    def total(self) -> int:
        return self.passed + len(self.failed)


def outcome(executed, committed=None) -> Outcome:
    """Count ``executed``'s check lines (nbformat nodes; ``executed`` None: the notebook left no output)."""
    verdicts = checks.tally(executed) if executed is not None else checks.Tally(0, [])
    printed = Counter(_same_claim(c) for c, _ in checks.check_lines(executed)) if executed is not None else Counter()
    missing = []
    for claim, _ in checks.check_lines(committed) if committed is not None else []:
        key = _same_claim(claim)
        if printed[key]:
            printed[key] -= 1
        else:
            missing.append(claim)
    return Outcome(passed=verdicts.passed, failed=list(verdicts.failed), missing=missing)


def run(runs: list[Run], *, profile: str, out_root: Path = MATRIX) -> list[dict]:
    """Execute every run into ``out_root/<nproc or once>/``; one row per run, with its outcome."""
    rows = []
    for r in runs:
        out_dir = out_root / r.folder
        (out_dir / r.chapter.file).unlink(missing_ok=True)  # an earlier matrix's output never counts for this one
        at = f"{r.parameter}={r.nproc}" if r.nproc is not None else "its own rank counts"
        print(f"--- {r.chapter.file} at {at}", flush=True)
        overrides = {r.parameter: r.nproc} if r.nproc is not None else {}
        row, = runner.run_chapters([r.chapter], in_place=False, profile=profile, overrides=overrides, out_dir=out_dir)
        out = Path(row["output"])
        executed = nbformat.read(out, as_version=4) if out.exists() else None
        committed = nbformat.read(r.chapter.path, as_version=4) if r.chapter.path.exists() else None
        result = outcome(executed, committed)
        if executed is None and row["status"] != "FAILED":  # not expected of run_chapters, but never counted as ok
            row["status"], row["error"] = "FAILED", "no executed notebook was written"
        row.update(nproc=r.nproc, passed=result.passed, total=result.total, failed=result.failed,
                   missing=result.missing, checks=f"{result.passed}/{result.total}" if executed is not None else "-")
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    """Per notebook and rank count: status, seconds, checks True/total; then every False and missing check."""
    width = max([len(r["notebook"]) for r in rows] + [8])
    lines = [f"{'notebook':<{width}}  {'nproc':>5}  {'status':<7}  {'seconds':>8}  {'checks':>7}", "-" * (width + 35)]
    for r in rows:
        nproc = "once" if r["nproc"] is None else str(r["nproc"])
        lines.append(f"{r['notebook']:<{width}}  {nproc:>5}  {r['status']:<7}  {r['seconds']:>8.1f}  {r['checks']:>7}")
        if r["error"] and not (r["failed"] and "check(s) printed False" in r["error"]):  # those are listed below
            lines.append(f"    {'error' if r['status'] == 'FAILED' else 'note'}: {r['error']}")
        lines += [f"    False: {c}" for c in r["failed"]]
        lines += [f"    missing: {c}" for c in r["missing"]]
    return "\n".join(lines)


def exit_status(rows: list[dict]) -> int:
    """1 when a notebook failed or any check printed False; SLOW and missing checks alone do not fail the matrix."""
    return 1 if any(r["status"] == "FAILED" or r["failed"] for r in rows) else 0


def main(argv: list[str] | None = None) -> int:
    import argparse

    from . import env

    parser = argparse.ArgumentParser(prog="python -m helpers.notebook.matrix", description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", help="ids (01), file names or stems; default: all")
    parser.add_argument("--nprocs", nargs="*", type=int, help="only these rank counts (of each notebook's own)")
    parser.add_argument("--profile", default="auto", help="auto (smoke on CPU, full on GPUs), smoke or full")
    parser.add_argument("--out", type=Path, default=MATRIX, help="output folder (default build/matrix)")
    args = parser.parse_args(argv)
    if args.nprocs is not None and (not args.nprocs or min(args.nprocs) < 1):
        parser.error("--nprocs takes rank counts of at least 1, e.g. --nprocs 1 3")

    _, chapters = runner.syllabus()
    runs, notes = plan(runner.select(chapters, args.notebooks), args.nprocs)
    profile = env.profile(args.profile)
    for note in notes:
        print(f"note: {note}")
    start = time.monotonic()
    rows = run(runs, profile=profile, out_root=args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(rows, indent=2) + "\n")
    print()
    print(f"profile: {profile}; {len(rows)} run(s) in {time.monotonic() - start:.0f}s; outputs in {args.out}/<nproc>/")
    for note in notes:
        print(f"note: {note}")
    print(table(rows))
    status = exit_status(rows)
    print("matrix: " + ("every notebook ran and every check printed True" if status == 0 else
                        "FAILED (a notebook failed or a check printed False)"))
    return status


if __name__ == "__main__":
    sys.exit(main())
