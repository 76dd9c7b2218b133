"""helpers.notebook.exercises.practice and .faults (notebooks 05 and 06): right answers pass, each kind of wrong answer gets its
own hint, nothing raises, and no hint gives the answer away."""
import doctest
import os
from pathlib import Path

import pytest
import torch

from helpers.notebook.exercises import Verdict, faults, practice
from helpers.notebook.exercises.faults import check_atomic_save, check_resume_point
from helpers.notebook.exercises.practice import check_warmup_lr
from helpers.rank.checkpoint import save_atomic

GARBAGE = ["twelve", None, [1, 2, 3], {"a": 1}, object(), float("nan"), True]


def test_docstring_examples_hold():
    results = [doctest.testmod(m, optionflags=doctest.ELLIPSIS) for m in (practice, faults)]
    assert sum(r.attempted for r in results) >= 4 and sum(r.failed for r in results) == 0


# --- check_warmup_lr -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("step, right", [(0, 0.0), (1, 0.0), (2, 0.001), (11, 0.01), (50, 0.01), (6, 0.005)])
def test_warmup_right_answers_pass(step, right):
    assert check_warmup_lr(right, step=step, lr=0.01, warmup_steps=10).ok
    assert check_warmup_lr(torch.tensor(right), step=step, lr=0.01, warmup_steps=10).ok


@pytest.mark.parametrize("answer, hint", [(0.006, "LambdaLR"), (0.01, "full rate"), (0.004, "One step off"),
                                          (0.01 * 0.77815, "log schedule"), (0.0123, "ramp")])
def test_warmup_each_mistake_gets_its_own_hint(answer, hint):
    v = check_warmup_lr(answer, step=6, lr=0.01, warmup_steps=10)
    assert not v.ok and hint in v.hint, v
    assert "0.005" not in str(v)


@pytest.mark.parametrize("answer", GARBAGE)
def test_warmup_garbage_gets_a_message(answer):
    v = check_warmup_lr(answer, step=6, lr=0.01, warmup_steps=10)
    assert isinstance(v, Verdict) and not v.ok and v.message


# --- check_resume_point ------------------------------------------------------------------------------------------


# (snapshot_every, fault_step, fault_rank) -> the one determined answer. Rank 0 alone writes snapshots, after the
# fault injector: if it dies on a snapshot step, that snapshot is never written; after any other step, every rank
# has passed the barrier of the last snapshot before it.
@pytest.mark.parametrize("every, fault, rank, right", [(5, 7, 0, (5, 2)), (5, 7, 1, (5, 2)), (5, 20, 0, (15, 5)),
                                                       (5, 23, 1, (20, 3)), (20, 61, 1, (60, 1)), (5, 3, 1, (0, 3)),
                                                       (5, 5, 0, (0, 5))])
def test_resume_right_answers_pass(every, fault, rank, right):
    assert check_resume_point(right, snapshot_every=every, fault_step=fault, fault_rank=rank).ok
    assert check_resume_point(list(right), snapshot_every=every, fault_step=fault, fault_rank=rank).ok


def test_resume_rank_defaults_to_the_writer():
    assert check_resume_point((15, 5), snapshot_every=5, fault_step=20).ok
    assert not check_resume_point((20, 0), snapshot_every=5, fault_step=20).ok


def test_resume_from_scratch_may_be_none():
    assert check_resume_point((None, 3), snapshot_every=5, fault_step=3, fault_rank=1).ok


def test_resume_the_exercise_answer_is_unique():
    """06's exercise 1: FAULT_RANK=0 FAULT_STEP=20, --snapshot-every 5. Exactly one answer passes."""
    passing = [(s, r) for s in range(0, 26) for r in range(0, 26)
               if check_resume_point((s, r), snapshot_every=5, fault_step=20, fault_rank=0).ok]
    assert passing == [(15, 5)]


def test_resume_another_rank_on_a_snapshot_step_is_a_race_and_says_so():
    """Rank 1 dying after step 20: rank 0 may or may not write step 20's snapshot before torchrun stops it."""
    for answer in ((20, 0), (15, 5)):
        v = check_resume_point(answer, snapshot_every=5, fault_step=20, fault_rank=1)
        assert v.ok and "race" in v.message, v
    v = check_resume_point((20, 5), snapshot_every=5, fault_step=20, fault_rank=1)
    assert not v.ok and "trained again" in v.hint, v


@pytest.mark.parametrize("answer, hint", [((20, 0), "before or after"), ((25, 0), "empty memory"),
                                          ((12, 8), "multiples"), ((10, 10), "NEWEST"), ((0, 20), "NEWEST"),
                                          ((15, 4), "including the fault step"), ((15, 6), "trained again")])
def test_resume_each_mistake_gets_its_own_hint(answer, hint):
    v = check_resume_point(answer, snapshot_every=5, fault_step=20, fault_rank=0)
    assert not v.ok and hint in v.hint, v
    assert "15" not in v.hint


@pytest.mark.parametrize("answer, hint", [((15, 3), "NEWEST"), ((20, 2), "including the fault step"),
                                          ((25, 0), "empty memory")])
def test_resume_off_snapshot_mistakes_get_their_hints(answer, hint):
    v = check_resume_point(answer, snapshot_every=5, fault_step=23, fault_rank=1)
    assert not v.ok and hint in v.hint, v


@pytest.mark.parametrize("answer", GARBAGE + [(1, 2, 3), ("a", "b")])
def test_resume_garbage_gets_a_message(answer):
    v = check_resume_point(answer, snapshot_every=5, fault_step=20, fault_rank=0)
    assert isinstance(v, Verdict) and not v.ok and v.message


@pytest.mark.slow
def test_resume_the_exercise_scenario_as_launched_gives_the_checked_answer():
    """06's exercise 1 launched as the notebook launches its faulty run: whatever the timing, attempt 1 resumes from
    step 15's snapshot and trains steps 16-20 again, the one answer the checker accepts."""
    from helpers import launch
    from helpers.rank import metrics

    args = ["--dataset", "synthetic", "--train-size", 1024, "--test-size", 64, "--epochs", 2, "--snapshot-every", 5]
    run = launch.torchrun("course/elastic_cifar10.py", nproc=2, args=args, max_restarts=1, timeout=900,
                          stall_timeout=120, name="test_exercise_06_resume", show="none",
                          env={"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "FAULT_RANK": 0, "FAULT_STEP": 20})
    redone = [r["step"] for r in metrics.steps(run.metrics, rank=0) if r["attempt"] == 1 and r["step"] <= 20]
    assert run.restarts == 1
    assert check_resume_point((run.result["resumed_from"], len(redone)), snapshot_every=5, fault_step=20,
                              fault_rank=0).ok, (run.result["resumed_from"], redone)
    assert redone == list(range(16, 21))


# --- check_atomic_save ---------------------------------------------------------------------------------------------


def atomic(state, path):
    tmp = Path(path).with_name("." + Path(path).name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def direct(state, path):
    torch.save(state, path)


def no_fsync(state, path):
    tmp = str(path) + ".tmp"
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def other_folder(state, path):
    import tempfile
    tmp = os.path.join(tempfile.gettempdir(), "practice_other_folder.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def copy_into_place(state, path):
    import shutil
    tmp = str(path) + ".tmp"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    shutil.copyfile(tmp, path)
    os.unlink(tmp)


def leaves_temp(state, path):
    tmp = str(path) + ".tmp"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def saves_nothing(state, path):
    pass


@pytest.mark.parametrize("fn", [atomic, save_atomic])
def test_atomic_right_answers_pass(fn):
    v = check_atomic_save(fn)
    assert v.ok, v


@pytest.mark.parametrize("fn, message, hint", [
    (direct, "corrupt file", "Write somewhere else first"),
    (no_fsync, "without an fsync", "fsync it before renaming"),
    (other_folder, "another folder", "next to the target"),
    (copy_into_place, "never produced by a rename", "Which os call"),
    (leaves_temp, "other file(s)", "remove the temporary file"),
    (saves_nothing, "no readable file", "under the name"),
])
def test_atomic_each_mistake_gets_its_own_hint(fn, message, hint):
    v = check_atomic_save(fn)
    assert not v.ok and message in v.message and hint in v.hint, v
    assert "os.replace" not in v.hint


def test_atomic_restores_the_patched_functions():
    before = (torch.save, os.replace, os.rename, os.fsync)
    check_atomic_save(direct)
    check_atomic_save(atomic)
    assert (torch.save, os.replace, os.rename, os.fsync) == before


@pytest.mark.parametrize("answer", GARBAGE)
def test_atomic_garbage_gets_a_message(answer):
    v = check_atomic_save(answer)
    assert isinstance(v, Verdict) and not v.ok and v.message
