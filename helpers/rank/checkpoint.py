"""Snapshots that survive crashes: atomic writes, step-numbered names, the newest one found on restart.

A training job that can be killed at any moment (a node fails, the scheduler preempts it, a rank is
OOM-killed) must never find half a file where its last snapshot should be. :func:`save_atomic` writes
to a temporary file in the same folder, flushes and fsyncs it, renames it over the target with
``os.replace`` (atomic on POSIX within one filesystem) and fsyncs the folder so the rename itself is on
disk. A reader sees the old file or the new one, never a mix.

Snapshots are named ``snapshot_<step, 8 digits>.pt``; temporary files start with a dot and end in
``.tmp``, so no pattern that finds snapshots can mistake a torn write for one. :func:`save_snapshot`
keeps the newest ``keep`` snapshots and deletes older ones (and temporary files crashed writers left).

Example::

    from helpers import checkpoint
    checkpoint.save_snapshot({"step": 40, "model": model.state_dict()}, "runs/x/snapshots", step=40, keep=2)
    path = checkpoint.latest_snapshot("runs/x/snapshots")      # .../snapshot_00000040.pt, or None
    state = checkpoint.load_snapshot(path)                      # {"step": 40, "model": {...}}
"""
from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Any, Mapping

import torch

SNAPSHOT_PATTERN = re.compile(r"^snapshot_(\d+)\.pt$")
TEMP_SUFFIX = ".tmp"


def snapshot_path(directory: str | os.PathLike, step: int) -> Path:
    """Where the snapshot taken after ``step`` goes: ``<directory>/snapshot_<step:08d>.pt``.

    Example::

        snapshot_path("snaps", 40)      # PosixPath('snaps/snapshot_00000040.pt')
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a whole number >= 0, got {step!r}")
    return Path(directory) / f"snapshot_{step:08d}.pt"


def snapshot_step(path: str | os.PathLike) -> int | None:
    """The step number in a snapshot's file name, or None if the name is not a snapshot's.

    Example::

        snapshot_step("snaps/snapshot_00000040.pt")     # 40
        snapshot_step("snaps/.snapshot_00000040.pt.123.tmp")  # None
    """
    m = SNAPSHOT_PATTERN.match(Path(path).name)
    return int(m.group(1)) if m else None


def _fsync_dir(directory: Path) -> None:
    """Make a rename or unlink in ``directory`` durable (the folder's entry list is data too)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory descriptors
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some filesystems refuse fsync on folders
        pass
    finally:
        os.close(fd)


def save_atomic(obj: Any, path: str | os.PathLike) -> Path:
    """``torch.save(obj)`` to ``path`` so that a crash at any moment leaves the old file or the new one.

    Steps: write to ``.<name>.<pid>.tmp`` in the same folder (same filesystem, or the rename would be a
    copy), flush Python's buffer, ``os.fsync`` the file (the data is on disk, not in the page cache),
    ``os.replace`` it over ``path`` (atomic), then fsync the folder (the rename is on disk). If anything
    fails before the rename, the temporary file is removed and the old ``path`` is untouched.

    Example::

        save_atomic(model.state_dict(), "runs/x/final_model.pt")
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}{TEMP_SUFFIX}"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def list_snapshots(directory: str | os.PathLike) -> list[Path]:
    """The snapshots in ``directory``, oldest step first; temporary files and other names are ignored.

    Example::

        [p.name for p in list_snapshots("snaps")]   # ['snapshot_00000035.pt', 'snapshot_00000040.pt']
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(snapshot_step(p), p) for p in directory.iterdir() if p.is_file()]
    return [p for step, p in sorted((s, p) for s, p in found if s is not None)]


def latest_snapshot(directory: str | os.PathLike) -> Path | None:
    """The snapshot with the highest step in ``directory``, or None when there is none (or no folder).

    Only complete files carry a snapshot's name (see :func:`save_atomic`), so the newest name is safe to load.

    Example::

        path = latest_snapshot("runs/x/snapshots")
        state = load_snapshot(path) if path else None
    """
    snapshots = list_snapshots(directory)
    return snapshots[-1] if snapshots else None


def load_snapshot(path: str | os.PathLike, map_location: Any = "cpu", weights_only: bool = True) -> Any:
    """Load a snapshot written by :func:`save_atomic` / :func:`save_snapshot`.

    ``weights_only=True`` (the safe unpickler) accepts tensors, dicts, lists, tuples, numbers, strings and
    None -- everything a model/optimizer/scheduler state dict and ``torch``/``random`` RNG states contain.
    Pass ``weights_only=False`` only for files you wrote yourself that hold other Python objects.

    Example::

        state = load_snapshot("runs/x/snapshots/snapshot_00000040.pt")
        model.load_state_dict(state["model"])
    """
    return torch.load(path, map_location=map_location, weights_only=weights_only)


def save_snapshot(obj: Any, directory: str | os.PathLike, step: int, keep: int = 2) -> Path:
    """Atomically write ``obj`` as the snapshot of ``step``, then delete all but the newest ``keep``.

    Leftover temporary files of writers that crashed mid-write are deleted too (only one process, rank
    0, should write snapshots into a folder). Keeping more than one snapshot guards against a snapshot
    that is complete but holds bad state (NaNs after a bad step): you can still go one further back.

    Example::

        save_snapshot(state, "runs/x/snapshots", step=40, keep=2)   # leaves snapshots 35 and 40
    """
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    path = save_atomic(obj, snapshot_path(directory, step))
    directory = path.parent
    for old in list_snapshots(directory)[:-keep]:
        old.unlink(missing_ok=True)
    mine = f".{os.getpid()}{TEMP_SUFFIX}"
    for stale in directory.glob(f".snapshot_*{TEMP_SUFFIX}"):
        if not stale.name.endswith(mine):
            stale.unlink(missing_ok=True)
    _fsync_dir(directory)
    return path


def state_dict_sha256(state_dict: Mapping[str, torch.Tensor]) -> str:
    """A fingerprint of a model's weights: sha256 over names, dtypes, shapes and the raw bytes, in key order.

    Two state dicts have the same fingerprint exactly when they are bitwise equal, so it is a cheap way to
    compare runs ("did the resumed run end with the same weights?") without shipping the tensors around.

    Example::

        state_dict_sha256(model.state_dict())    # '3f1c...'
    """
    h = hashlib.sha256()
    for name in sorted(state_dict):
        t = state_dict[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
