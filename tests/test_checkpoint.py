"""helpers.rank.checkpoint: atomic snapshot writes, step-numbered names, the newest snapshot found after a crash.

The crash tests run the writer in a child process and SIGKILL it in the middle of a write -- no cleanup
code runs, as after a power cut, the OOM killer or a preempted node -- then check what a restarted job
would see. The child's file writes are slowed down (a stand-in for a slow network filesystem) so the kill
lands while the temporary file is demonstrably half written.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers.rank.checkpoint import (latest_snapshot, list_snapshots, load_snapshot, save_atomic, save_snapshot,
                                snapshot_path, snapshot_step, state_dict_sha256)

REPO = Path(__file__).resolve().parents[1]
BIG_NUMEL = 8 * 2**20  # a 32 MiB float32 tensor: written in 1 MiB chunks by the slowed-down child

# The child: writes snapshot 10 (a big tensor) into argv[1] and is killed by the test part-way.
#   mode "writing":        save_snapshot with file writes slowed down -> killed while the temp file grows
#   mode "before_rename":  save_snapshot whose os.replace never returns -> killed with a complete temp file
#   mode "plain":          torch.save straight onto the snapshot's own name, slowed down -> killed mid-write
CHILD = r"""
import os, sys, time, builtins
import torch
from helpers.rank import checkpoint

directory, mode, numel = sys.argv[1], sys.argv[2], int(sys.argv[3])

class SlowFile:
    '''A file whose writes trickle out 1 MiB at a time, so a kill lands mid-write.'''
    def __init__(self, f): self.f = f
    def write(self, data):
        view = memoryview(data).cast("B")
        for i in range(0, len(view), 2**20):
            self.f.write(view[i:i + 2**20]); self.f.flush(); time.sleep(0.1)
        return len(view)
    def __getattr__(self, name): return getattr(self.f, name)
    def __enter__(self): return self
    def __exit__(self, *exc): return self.f.__exit__(*exc)

def slow_open(*args, **kwargs):
    return SlowFile(builtins.open(*args, **kwargs))

state = {"step": 10, "weights": torch.full((numel,), 10.0)}
if mode == "writing":
    checkpoint.open = slow_open            # module-level name shadows the builtin inside helpers.rank.checkpoint
    checkpoint.save_snapshot(state, directory, step=10)
elif mode == "before_rename":
    def never_returns(*args):
        print("TEMP FILE COMPLETE", flush=True)
        time.sleep(600)
    checkpoint.os.replace = never_returns
    checkpoint.save_snapshot(state, directory, step=10)
elif mode == "plain":
    with slow_open(checkpoint.snapshot_path(directory, 10), "wb") as f:
        torch.save(state, f)
print("WRITE FINISHED (the test should have killed me before this)", flush=True)
"""


def _previous_snapshot(directory: Path) -> dict:
    state = {"step": 5, "weights": torch.arange(16, dtype=torch.float32), "note": "the good one"}
    save_snapshot(state, directory, step=5)
    return state


def _kill_writer_mid_write(directory: Path, mode: str) -> subprocess.Popen:
    """Start the child writer, wait until its write is observably under way, SIGKILL it."""
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(directory), mode, str(BIG_NUMEL)], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        if mode == "before_rename":
            line = child.stdout.readline()  # blocks until the temp file is written, fsynced, and not yet renamed
            assert "TEMP FILE COMPLETE" in line, line + child.stdout.read()
        else:
            target = "snapshot_00000010.pt" if mode == "plain" else ".snapshot_00000010.pt.*.tmp"
            sizes = []
            while time.monotonic() < deadline and child.poll() is None:
                files = list(directory.glob(target))
                sizes.append(files[0].stat().st_size if files else 0)
                if len(sizes) >= 2 and sizes[-1] > sizes[-2] >= 2**20:  # exists, has data, still growing
                    break
                time.sleep(0.05)
            assert child.poll() is None, f"the writer finished or died before the kill: {child.stdout.read()}"
            assert sizes and sizes[-1] > 0, "the write never started"
        os.killpg(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait(timeout=30)
        child.stdout.close()
    assert child.returncode == -signal.SIGKILL
    return child


# ---------------------------------------------------------------------------------------------
# names and listing


def test_snapshot_names_carry_the_step_and_sort_by_it(tmp_path):
    assert snapshot_path(tmp_path, 40) == tmp_path / "snapshot_00000040.pt"
    assert snapshot_step(tmp_path / "snapshot_00000040.pt") == 40
    for step in (100, 5, 40):
        save_atomic({"step": step}, snapshot_path(tmp_path, step))
    assert [snapshot_step(p) for p in list_snapshots(tmp_path)] == [5, 40, 100]
    assert latest_snapshot(tmp_path) == snapshot_path(tmp_path, 100)


def test_temporary_and_foreign_files_are_never_taken_for_snapshots(tmp_path):
    save_atomic({"step": 3}, snapshot_path(tmp_path, 3))
    for name in (".snapshot_00000009.pt.1234.tmp", "snapshot_00000009.pt.tmp", "snapshot_9.pt.bak",
                 "final_model.pt", "fault_injected", "snapshot_00000009.ptx"):
        (tmp_path / name).write_bytes(b"torn")
    (tmp_path / "snapshot_00000099.pt").mkdir()  # a folder with a snapshot's name is not a snapshot either
    assert snapshot_step(tmp_path / ".snapshot_00000009.pt.1234.tmp") is None
    assert [p.name for p in list_snapshots(tmp_path)] == ["snapshot_00000003.pt"]


def test_latest_snapshot_is_none_for_a_missing_or_empty_folder(tmp_path):
    assert latest_snapshot(tmp_path / "does-not-exist") is None
    assert latest_snapshot(tmp_path) is None


def test_negative_or_non_integer_steps_are_refused(tmp_path):
    for bad in (-1, 1.5, "7", True):
        with pytest.raises(ValueError):
            snapshot_path(tmp_path, bad)


# ---------------------------------------------------------------------------------------------
# writing


def test_save_atomic_round_trips_and_leaves_no_temporary_file(tmp_path):
    state = {"model": {"w": torch.randn(3, 4)}, "step": 7, "rng": torch.get_rng_state(), "py": (3, (1, 2), None)}
    path = save_atomic(state, tmp_path / "sub" / "state.pt")  # creates the folder
    loaded = load_snapshot(path)
    assert torch.equal(loaded["model"]["w"], state["model"]["w"]) and torch.equal(loaded["rng"], state["rng"])
    assert loaded["step"] == 7 and loaded["py"] == (3, (1, 2), None)
    assert [p.name for p in path.parent.iterdir()] == ["state.pt"]


class _Unpicklable:
    def __reduce__(self):
        raise RuntimeError("cannot pickle this")


def test_a_failed_save_keeps_the_old_file_and_removes_its_temporary_file(tmp_path):
    path = save_atomic({"version": 1}, tmp_path / "state.pt")
    with pytest.raises(RuntimeError, match="cannot pickle"):
        save_atomic({"version": 2, "bad": _Unpicklable()}, path)
    assert load_snapshot(path) == {"version": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["state.pt"]


def test_save_snapshot_keeps_only_the_newest_k(tmp_path):
    for step in range(5, 30, 5):
        save_snapshot({"step": step}, tmp_path, step, keep=2)
    assert [snapshot_step(p) for p in list_snapshots(tmp_path)] == [20, 25]
    with pytest.raises(ValueError):
        save_snapshot({"step": 30}, tmp_path, 30, keep=0)


def test_save_snapshot_removes_temporary_files_of_crashed_writers(tmp_path):
    stale = tmp_path / ".snapshot_00000010.pt.999999.tmp"
    stale.write_bytes(b"half a snapshot")
    save_snapshot({"step": 15}, tmp_path, 15)
    assert not stale.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["snapshot_00000015.pt"]


def test_weights_fingerprint_sees_a_one_bit_change_and_nothing_else(tmp_path):
    a = {"w": torch.randn(5, 5), "b": torch.zeros(5), "n": torch.tensor(3)}
    b = {k: v.clone() for k, v in reversed(list(a.items()))}  # same tensors, other key order
    assert state_dict_sha256(a) == state_dict_sha256(b)
    b["w"].view(torch.int32)[2, 3] ^= 1  # flip the lowest bit of one float
    assert state_dict_sha256(a) != state_dict_sha256(b)
    assert state_dict_sha256({"w": torch.zeros(2)}) != state_dict_sha256({"w": torch.zeros(2, dtype=torch.float64)})


# ---------------------------------------------------------------------------------------------
# a writer killed mid-write


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["writing", "before_rename"])
def test_writer_killed_mid_write_leaves_the_previous_snapshot_loadable(tmp_path, mode):
    previous = _previous_snapshot(tmp_path)
    _kill_writer_mid_write(tmp_path, mode)

    torn = list(tmp_path.glob(".snapshot_00000010.pt.*.tmp"))
    assert len(torn) == 1, "the killed writer should have left its temporary file behind"
    full_size = BIG_NUMEL * 4
    if mode == "writing":
        assert 0 < torn[0].stat().st_size < full_size, "the kill should land in the middle of the write"
    else:
        assert torn[0].stat().st_size > full_size  # complete and fsynced, but never renamed

    # What a restarted job sees: snapshot 5, intact; the torn write is invisible.
    assert not snapshot_path(tmp_path, 10).exists()
    assert latest_snapshot(tmp_path) == snapshot_path(tmp_path, 5)
    loaded = load_snapshot(latest_snapshot(tmp_path))
    assert loaded["note"] == "the good one" and torch.equal(loaded["weights"], previous["weights"])

    # The next snapshot the restarted job writes clears the leftover.
    save_snapshot({"step": 15}, tmp_path, 15)
    assert not list(tmp_path.glob("*.tmp"))
    assert [snapshot_step(p) for p in list_snapshots(tmp_path)] == [5, 15]
