"""A run's profiler traces in the notebook: read every rank's, write the merged one, draw one step per rank.

A course script launched with ``--profile-steps N`` leaves ``trace_rank<R>.json`` per rank in its run directory
(:class:`helpers.rank.harness.Meter`); :mod:`helpers.calc.traces` classifies and splits them. Here:
:func:`load` reads them, :func:`write_merged` writes ``trace.json`` beside them (one lane per rank: open it in
https://ui.perfetto.dev or chrome://tracing when one is at hand), :func:`plot_step` draws one profiled step with
matplotlib, compute and communication per rank, for a learner with no trace viewer.

Example (a notebook cell)::

    run = launch.torchrun("course/gpt_train.py", nproc=2, args=["--steps", 8, "--profile-steps", 2])
    split = traces.split(run)                # {rank: [{"step", "span", "compute", "comm", "exposed"}, ...]}
    fig = traces.plot_step(run, step=0)
"""
from __future__ import annotations

import json
from pathlib import Path

from ..calc import traces as calc

COLORS = {"compute": "tab:blue", "comm": "tab:orange"}


def load(run) -> dict[int, dict]:
    """Every rank's trace of ``run`` (a :class:`helpers.launch.Run` or its run directory), by rank."""
    folder = Path(getattr(run, "run_dir", run))
    found = {int(p.stem.removeprefix("trace_rank")): json.loads(p.read_text())
             for p in sorted(folder.glob("trace_rank*.json"))}
    if not found:
        raise FileNotFoundError(f"no trace_rank*.json in {folder}: launch the script with --profile-steps N")
    return found


_parsed: dict[tuple, list[dict]] = {}  # a finished run's traces do not change: parse each set of files once


def spans(run) -> list[dict]:
    """:func:`helpers.calc.traces.spans_of` the run's traces, parsed once per set of trace files (a notebook's
    table, plots and claims all read the same run; each trace is megabytes of JSON)."""
    folder = Path(getattr(run, "run_dir", run))
    key = (str(folder.resolve()), tuple((p.name, p.stat().st_mtime_ns, p.stat().st_size)
                                        for p in sorted(folder.glob("trace_rank*.json"))))
    if key not in _parsed:
        _parsed[key] = calc.spans_of(load(run))
    return _parsed[key]


def split(run) -> dict[int, list[dict]]:
    """:func:`helpers.calc.traces.step_split` of the run's traces."""
    return calc.step_split(spans(run))


def write_merged(run) -> Path:
    """``trace.json`` in the run directory: all ranks on one timeline, a lane per rank."""
    path = Path(getattr(run, "run_dir", run)) / "trace.json"
    path.write_text(json.dumps(calc.merge(load(run))))
    return path


def plot_step(run, step: int = 0, ax=None):
    """The ``step``-th profiled step (negative: from the last) of every rank on one time axis (milliseconds from the
    earliest rank's step start): a row per rank for compute and one for communication; the exposed communication
    hatched."""
    import matplotlib.pyplot as plt

    grouped = calc.by_rank(spans(run))
    ranks = sorted(grouped)
    steps = {r: sorted((s for s in grouped[r] if s["kind"] == "step"), key=lambda s: s["t0"]) for r in ranks}
    if any(not -len(v) <= step < len(v) for v in steps.values()):
        raise ValueError(f"step {step} was not profiled on every rank ({ {r: len(v) for r, v in steps.items()} })")
    zero = min(steps[r][step]["t0"] for r in ranks)
    if ax is None:
        _, ax = plt.subplots(figsize=(11, 0.9 + 0.7 * len(ranks)))
    rows = []
    for i, r in enumerate(ranks):
        lo, hi = steps[r][step]["t0"], steps[r][step]["t1"]
        mine = grouped[r]
        compute = calc.clip(calc.compute(mine), lo, hi)
        comm = calc.clip(calc.union((s["t0"], s["t1"]) for s in mine if s["kind"] == "comm"), lo, hi)
        for row, (kind, intervals) in enumerate((("compute", compute), ("comm", comm))):
            y = 2 * i + row
            ax.broken_barh([((a - zero) / 1e3, (b - a) / 1e3) for a, b in intervals], (y - 0.4, 0.8),
                           color=COLORS[kind])
            rows.append(f"rank {r} {kind}")
        exposed = calc.minus(comm, compute)
        ax.broken_barh([((a - zero) / 1e3, (b - a) / 1e3) for a, b in exposed], (2 * i + 0.6, 0.8),
                       facecolor="none", edgecolor="black", hatch="///")
    ax.set(yticks=range(len(rows)), yticklabels=rows, xlabel="ms from the step's start",
           title="one profiled step: compute and communication per rank (hatched: exposed communication)")
    ax.invert_yaxis()
    return ax.figure
