"""Steady-state throughput: the one definition of ``samples_per_s`` in this course.

A training step's wall time is measured on every rank (``step_s``, :class:`helpers.rank.metrics.TrainStep`). The
job moves at the pace of its slowest rank, and the first steps pay one-off costs (allocator warm-up, DDP's first
bucketing, lazy initialisation, ``torch.compile``), so:

    samples_per_s = samples per step (all ranks) / median over the steps after the first ``skip`` of
                    (the slowest rank's step_s of that step)

The median, not the mean, so one step the operating system interrupted does not move it. Every ``course/`` script
reports its result with this function (through the rank-side harness) and notebooks compute it from the step
records with the same function, so the two agree.

Example::

    steady_samples_per_s([[0.9, 0.1, 0.1, 0.2], [1.0, 0.1, 0.12, 0.1]], samples_per_step=64, skip=1)  # 533.3...
"""
from __future__ import annotations

import statistics
from typing import Iterable, Mapping, Sequence


def slowest_rank_step_s(step_s_by_rank: Mapping[int, Sequence[float]] | Sequence[Sequence[float]]) -> list[float]:
    """Per step, the largest ``step_s`` over the ranks: the time the whole job spent on it.

    Every rank must have timed the same steps (a collective in each step keeps them in lock step); a rank with a
    different count is refused, since its steps could not be paired."""
    series = list(step_s_by_rank.values()) if isinstance(step_s_by_rank, Mapping) else list(step_s_by_rank)
    if not series:
        return []
    lengths = {len(s) for s in series}
    if len(lengths) != 1:
        raise ValueError(f"every rank must time the same steps; step counts per rank: {[len(s) for s in series]}")
    return [max(values) for values in zip(*series)]


def steady_step_s(step_s_by_rank, skip: int) -> list[float]:
    """The slowest rank's step times of the steady-state steps: all but the first ``skip``."""
    if isinstance(skip, bool) or not isinstance(skip, int) or skip < 0:
        raise ValueError(f"skip must be a whole number >= 0, got {skip!r}")
    return slowest_rank_step_s(step_s_by_rank)[skip:]


def steady_samples_per_s(step_s_by_rank, samples_per_step: float, skip: int) -> float | None:
    """Samples per second of the whole job in the steady state (module docstring), or None when no step is left
    after the first ``skip``."""
    timed = steady_step_s(step_s_by_rank, skip)
    if not timed:
        return None
    return samples_per_step / statistics.median(timed)


def median_spread(values: Iterable[float]) -> tuple[float, float, float]:
    """(median, min, max) of repeated measurements: how a timing worth stating is reported here."""
    xs = sorted(values)
    if not xs:
        raise ValueError("no values")
    return statistics.median(xs), xs[0], xs[-1]


def window_samples_per_s(step_s_by_rank, samples_per_step: float, skip: int, windows: int) -> list[float]:
    """Steady-state samples/s of ``windows`` consecutive, equal windows of one run's steps after the first ``skip``
    (each window's rate from the median of its slowest-rank step times, like :func:`steady_samples_per_s`).

    Repeating the timed window inside one launch measures the spread of a steady state without paying a launch (and
    the framework's start-up) per repeat; :func:`median_spread` of the result is how it is stated. Steps that do not
    fill a whole window at the end are left out. Refuses fewer steps than windows.

    Example::

        window_samples_per_s([[9.0, 0.1, 0.1, 0.2, 0.2]], samples_per_step=10, skip=1, windows=2)  # [100.0, 50.0]
    """
    if isinstance(windows, bool) or not isinstance(windows, int) or windows < 1:
        raise ValueError(f"windows must be a whole number >= 1, got {windows!r}")
    timed = steady_step_s(step_s_by_rank, skip)
    size = len(timed) // windows
    if size == 0:
        raise ValueError(f"{len(timed)} steady-state steps cannot fill {windows} windows: run more steps")
    return [samples_per_step / statistics.median(timed[i * size:(i + 1) * size]) for i in range(windows)]
