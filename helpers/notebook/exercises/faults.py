"""Checkers for the exercises of notebook 06 (fault tolerance).

Every checker returns a :class:`~helpers.notebook.exercises.Verdict` and never raises; hints name the idea that is
missing and never print the expected answer.

* :func:`check_resume_point` -- which snapshot a restart of ``course/elastic_cifar10.py`` resumes from, and how many
  steps it trains again, when a given rank dies after a given step.
* :func:`check_atomic_save` -- a ``save(state, path)`` that a crash mid-write cannot corrupt. It runs the learner's
  function, once normally and once with ``torch.save`` failing half-way.

Example::

    from helpers.notebook.exercises import faults
    faults.check_resume_point((15, 5), snapshot_every=5, fault_step=20, fault_rank=0)
    # Correct: rank 0 writes the snapshots, and it died after step 20 before writing that step's, ...
"""
from __future__ import annotations

import contextlib
import io
import os
import tempfile
from pathlib import Path

from ..i18n import _
from . import Verdict, _never_raises, _whole_number

# --- 06, exercise 1: where a restart resumes ---------------------------------------------------------------------


def _pair(answer):
    if isinstance(answer, (str, bytes)) or not hasattr(answer, "__len__") or len(answer) != 2:
        return None
    first = 0 if answer[0] is None else _whole_number(answer[0])
    second = _whole_number(answer[1])
    return None if first is None or second is None else (first, second)


@_never_raises
def check_resume_point(answer, *, snapshot_every: int, fault_step: int, fault_rank: int = 0) -> Verdict:
    """``(resume_step, redone)`` for ``course/elastic_cifar10.py``: the step of the snapshot the restart loads (0
    or None: from scratch) and how many steps it trains again, when rank ``fault_rank`` dies right after step
    ``fault_step``.

    The script, after each step: reports it, runs the fault injector (which may exit), then, on multiples of
    ``--snapshot-every``, rank 0 alone writes the snapshot and every rank meets at a barrier. So:

    * if rank 0 dies after a multiple of ``snapshot_every``, that step's snapshot is never written;
    * if any rank dies after any other step, the newest snapshot is that of the last multiple before it, whose
      barrier every rank passed (a rank cannot get past the next step's all-reduce without the dead one);
    * if another rank dies after a multiple, nothing orders rank 0's write against torchrun stopping it: whether
      that step's snapshot reaches the disk is a race, and the checker accepts either outcome and says so.

    Example::

        >>> check_resume_point((5, 2), snapshot_every=5, fault_step=7)
        Correct: the newest snapshot on disk is step 5's; the restart trains steps 6 to 7 again (2 steps).
        >>> check_resume_point((15, 5), snapshot_every=5, fault_step=20, fault_rank=0).ok
        True
    """
    got = _pair(answer)
    if got is None:
        return Verdict(False, _("expected two whole numbers (resume_step, redone), got {answer!r}.", answer=answer),
                       _("Answer with a tuple such as (40, 3)."))
    resume, redone = got
    on_snapshot_step = fault_step > 0 and fault_step % snapshot_every == 0
    if on_snapshot_step and fault_rank != 0 and (resume, redone) in ((fault_step, 0),
                                                                     (fault_step - snapshot_every, snapshot_every)):
        return Verdict(True, _("it depends on a race: rank 0, the only writer, may or may not finish step "
                               "{fault_step}'s snapshot before torchrun stops it, so the restart resumes from step "
                               "{fault_step} (nothing redone) or from step {earlier} ({every} steps redone).",
                               fault_step=fault_step, earlier=fault_step - snapshot_every, every=snapshot_every))
    if on_snapshot_step and fault_rank == 0:
        right = fault_step - snapshot_every  # the writer died before writing this step's snapshot
    elif on_snapshot_step and resume == fault_step:
        right = fault_step  # one outcome of the race: judge the steps redone against it
    else:
        right = (max(fault_step, 0) // snapshot_every) * snapshot_every
    right_redone = fault_step - right
    if (resume, redone) == (right, right_redone):
        if on_snapshot_step and fault_rank == 0:
            return Verdict(True, _("rank 0 writes the snapshots, and it died after step {fault_step} before writing "
                                   "that step's, so the newest on disk is step {right}'s; the restart trains steps "
                                   "{first} to {fault_step} again ({redone} steps). (Had another rank died there, "
                                   "rank 0 could have written step {fault_step}'s first: a race.)",
                                   right=right, first=right + 1, fault_step=fault_step, redone=right_redone))
        if right_redone == 1:
            return Verdict(True, _("the newest snapshot on disk is step {right}'s; the restart trains steps {first} "
                                   "to {fault_step} again ({redone} step).",
                                   right=right, first=right + 1, fault_step=fault_step, redone=right_redone))
        return Verdict(True, _("the newest snapshot on disk is step {right}'s; the restart trains steps {first} "
                               "to {fault_step} again ({redone} steps).",
                               right=right, first=right + 1, fault_step=fault_step, redone=right_redone))
    if resume != right:
        wrong = _("the restart does not resume from step {resume}.", resume=resume)
        if resume == fault_step and on_snapshot_step:
            return Verdict(False, wrong, _("Look at the order of the lines after each step in the script's loop: "
                                           "does the fault injector run before or after that step's snapshot is "
                                           "written?"))
        if resume >= fault_step:
            return Verdict(False, wrong, _("A restart starts new processes with empty memory: it can only load a "
                                           "snapshot written before the rank died."))
        if resume % snapshot_every:
            return Verdict(False, wrong, _("Snapshots are written only on multiples of --snapshot-every."))
        if resume < right:
            return Verdict(False, wrong, _("Every rank loads the NEWEST snapshot on disk (the script keeps two); is "
                                           "there a later one than that?"))
        return Verdict(False, wrong, _("Find the last step, at or before the fault, whose snapshot was written."))
    if redone == fault_step - resume - 1:
        return Verdict(False, _("right snapshot, but not {redone} steps redone.", redone=redone),
                       _("The step the rank finished just before it died is lost too: count every step after the "
                         "snapshot's, up to and including the fault step."))
    return Verdict(False, _("right snapshot, but not {redone} steps redone.", redone=redone),
                   _("The snapshot holds the state after its step; everything after it, up to the fault, is trained "
                     "again."))


# --- 06, exercise 2: an atomic save ------------------------------------------------------------------------------


class _Crash(RuntimeError):
    """What the patched ``torch.save`` raises half-way through a write."""


@_never_raises
def check_atomic_save(save) -> Verdict:
    """Is ``save(state, path)`` crash-safe? Runs it three times in a temporary folder:

    1. a normal save must produce a file ``torch.load`` reads back;
    2. a second save with ``torch.save`` failing half-way (after writing half the bytes) must leave the file of
       step 1 intact at ``path``, and no half-written file under the snapshot's name;
    3. the data must reach the disk before the rename (``os.fsync`` called before ``os.replace``/``os.rename``),
       and the temporary file must be in the same folder (a rename across filesystems is a copy).

    Example::

        >>> import torch
        >>> print(check_atomic_save(lambda state, path: torch.save(state, path)).message)
        a crash half-way through the second save left a corrupt file where the first one was.
    """
    import torch

    if not callable(save):
        return Verdict(False, _("expected a function save(state, path), got {answer_type}.",
                                answer_type=type(save).__name__),
                       _("Define the function in the answer cell and pass it, without calling it."))
    real_save, real_replace, real_rename, real_fsync = torch.save, os.replace, os.rename, os.fsync
    log: list = []

    def crashing_save(obj, f, *args, **kwargs):
        buf = io.BytesIO()
        real_save(obj, buf, *args, **kwargs)
        half = buf.getvalue()[: len(buf.getvalue()) // 2]
        if hasattr(f, "write"):
            f.write(half)
            log.append(("save", getattr(f, "name", None)))
        else:
            Path(f).write_bytes(half)
            log.append(("save", str(f)))
        raise _Crash("simulated crash in the middle of torch.save")

    def recording_save(obj, f, *args, **kwargs):
        log.append(("save", getattr(f, "name", None) if hasattr(f, "write") else str(f)))
        return real_save(obj, f, *args, **kwargs)

    def replace(src, dst, *a, **k):
        log.append(("rename", str(src), str(dst)))
        return real_replace(src, dst, *a, **k)

    def rename(src, dst, *a, **k):
        log.append(("rename", str(src), str(dst)))
        return real_rename(src, dst, *a, **k)

    def fsync(fd):
        log.append(("fsync", fd))
        return real_fsync(fd)

    with tempfile.TemporaryDirectory(prefix="atomic_save_check_") as tmp:
        path = Path(tmp) / "snapshots" / "snapshot_00000010.pt"
        path.parent.mkdir()
        first, second = {"step": 10, "w": torch.arange(64.0)}, {"step": 20, "w": -torch.arange(64.0)}
        try:
            torch.save, os.replace, os.rename, os.fsync = recording_save, replace, rename, fsync
            try:
                save(first, str(path))
            except Exception as e:  # noqa: BLE001 - the learner's code failed: say so
                return Verdict(False, _("a normal save raised {error_type}: {error}", error_type=type(e).__name__,
                                        error=e),
                               _("Run your function once by hand on a small dict and a path, and read the error."))
            try:
                back = torch.load(path, weights_only=True)
            except Exception:  # noqa: BLE001
                return Verdict(False, _("after a normal save, there is no readable file at the path."),
                               _("Whatever happens in between, the snapshot must end up under the name it was asked "
                                 "for."))
            if back.get("step") != 10 or not torch.equal(back["w"], first["w"]):
                return Verdict(False, _("the file at the path does not hold the state that was saved."),
                               _("Save the state you are given."))
            normal = list(log)
            log.clear()
            torch.save = crashing_save
            with contextlib.suppress(_Crash):
                save(second, str(path))
        finally:
            torch.save, os.replace, os.rename, os.fsync = real_save, real_replace, real_rename, real_fsync
        try:
            survived = torch.load(path, weights_only=True)
            intact = survived.get("step") == 10 and torch.equal(survived["w"], first["w"])
        except Exception:  # noqa: BLE001 - a torn file is exactly what this detects
            intact = False
        if not intact:
            return Verdict(False, _("a crash half-way through the second save left a corrupt file where the first "
                                    "one was."),
                           _("Writing straight to the final name destroys the old file before the new one is "
                             "complete. Write somewhere else first, and only put the finished file in place, in one "
                             "step that cannot be half done."))
        renames = [e for e in normal if e[0] == "rename"]
        saves = [e for e in normal if e[0] == "save"]
        if not renames:
            return Verdict(False, _("the file survived, but the final name is never produced by a rename."),
                           _("Copying the finished file into place is not atomic either: a crash during the copy "
                             "tears it. Which os call moves a file to a new name in one step?"))
        target = renames[-1]
        if Path(target[2]).resolve() != path.resolve():
            return Verdict(False, _("the last rename does not produce the snapshot's name."),
                           _("Rename the finished temporary file onto the path you were given."))
        if Path(target[1]).resolve().parent != path.resolve().parent:
            return Verdict(False, _("the temporary file is in another folder than the snapshot."),
                           _("A rename is atomic only within one filesystem; across them it becomes a copy. Put the "
                             "temporary file next to the target."))
        if saves and saves[0][1] is not None and Path(saves[0][1]).resolve() == path.resolve():
            return Verdict(False, _("the state is first written to the snapshot's own name."),
                           _("Write the new state under another name first."))
        rename_at = normal.index(target)
        if not any(e[0] == "fsync" for e in normal[:rename_at]):
            return Verdict(False, _("the file is renamed into place without an fsync first."),
                           _("After a power loss the rename can be on disk while the data is still in the page "
                             "cache: flush the file and fsync it before renaming."))
        leftovers = [p.name for p in path.parent.iterdir() if p.name != path.name]
        if leftovers:
            return Verdict(False, _("the failed save left {count} other file(s) in the folder.", count=len(leftovers)),
                           _("Not fatal, but a folder fills up with torn temporaries: remove the temporary file when "
                             "the write fails (try/except, then re-raise)."))
    return Verdict(True, _("a crash mid-write leaves the previous file intact; the data is fsynced, then renamed "
                           "into place within its folder."))
