"""Metrics written by rank processes and read back by notebooks.

Rank side: :class:`Reporter` appends one JSON object per line to ``<run_dir>/metrics.jsonl``.
Every record carries ``rank``, ``t`` (unix seconds) and ``kind``:

* ``kind="step"``  -- a training/benchmark step: ``step`` plus free fields (``loss``, ``samples``...).
* ``kind="total"`` -- how many steps rank 0 expects (feeds the launcher's progress bar).
* ``kind="result"`` -- final facts of the run (accuracy, checkpoint path...), merged into ``Run.result``.
* ``kind="event"`` -- anything else worth recording (``name`` plus fields).

The run directory comes from the ``HELPERS_RUN_DIR`` variable that :mod:`helpers.launch` sets, or
from the ``run_dir`` argument. Run from a plain terminal without either, the reporter is a no-op,
so course scripts stay runnable with bare ``torchrun``.

Example (inside a rank)::

    rep = Reporter()
    rep.total(100)
    for step in range(100):
        ...
        rep.step(step, loss=loss.item(), samples=batch_size)
    rep.result(test_accuracy=0.71)
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Iterable

METRICS_FILE = "metrics.jsonl"
RUN_DIR_ENV = "HELPERS_RUN_DIR"


def _rank_from_env() -> int:
    return int(os.environ.get("RANK", "0"))


def _jsonable(value: Any) -> Any:
    """Tensors and numpy scalars become plain Python numbers; everything else passes through."""
    if hasattr(value, "item") and callable(value.item):
        try:
            return value.item()
        except (ValueError, RuntimeError):
            pass
    if hasattr(value, "tolist"):
        return value.tolist()
    return value


class Reporter:
    """Append-only JSON-lines writer, safe to share between ranks.

    Each record is written with a single ``os.write`` on an ``O_APPEND`` descriptor, so lines from
    different ranks never interleave (POSIX appends of one small buffer are atomic on a local file).
    """

    def __init__(self, run_dir: str | os.PathLike | None = None, rank: int | None = None):
        run_dir = run_dir if run_dir is not None else os.environ.get(RUN_DIR_ENV)
        self.rank = _rank_from_env() if rank is None else int(rank)
        self.path = Path(run_dir) / METRICS_FILE if run_dir else None
        self._fd = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    @property
    def enabled(self) -> bool:
        return self._fd is not None

    def write(self, kind: str, **fields: Any) -> None:
        if self._fd is None:
            return
        record = {"kind": kind, "rank": self.rank, "t": time.time()}
        record.update({k: _jsonable(v) for k, v in fields.items()})
        os.write(self._fd, (json.dumps(record) + "\n").encode())

    def step(self, step: int, **fields: Any) -> None:
        self.write("step", step=int(step), **fields)

    def total(self, steps: int) -> None:
        self.write("total", steps=int(steps))

    def result(self, **fields: Any) -> None:
        self.write("result", **fields)

    def event(self, name: str, **fields: Any) -> None:
        self.write("event", name=name, **fields)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "Reporter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """All complete records of a run, in file order. A torn last line (rank killed mid-write) is skipped."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def steps(records: Iterable[dict], rank: int | None = None) -> list[dict]:
    """The ``step`` records, optionally of one rank, sorted by (rank, step)."""
    out = [r for r in records if r.get("kind") == "step" and (rank is None or r.get("rank") == rank)]
    return sorted(out, key=lambda r: (r.get("rank", 0), r.get("step", 0)))


def results(records: Iterable[dict]) -> dict:
    """Merge the ``result`` records: rank 0's values win, other ranks fill keys rank 0 did not set."""
    merged: dict = {}
    for r in sorted((r for r in records if r.get("kind") == "result"), key=lambda r: -r.get("rank", 0)):
        merged.update({k: v for k, v in r.items() if k not in ("kind", "t")})
    merged.pop("rank", None)
    return merged


def series(records: Iterable[dict], field: str, rank: int = 0) -> tuple[list[int], list[float]]:
    """(steps, values) of one field for one rank, for plotting."""
    xs, ys = [], []
    for r in steps(records, rank):
        if field in r:
            xs.append(r["step"])
            ys.append(r[field])
    return xs, ys
