"""helpers.notebook.lessons.faults (notebook 06): each claim says True on the runs the lesson describes and False on
runs that break it, and the log readers find what they print (or refuse logs that lack it)."""
from types import SimpleNamespace

import pytest
import torch

from helpers.launch import PROJECT_ROOT
from helpers.notebook import checks
from helpers.notebook.lessons import faults as lesson
from helpers.rank import checkpoint


def verdicts(capsys) -> dict[str, bool]:
    return dict(checks.parse(capsys.readouterr().out))


# --- plan, tidy -------------------------------------------------------------------------------------------------------

def test_plan_counts_steps_and_refuses_too_few_for_the_fault(capsys):
    lesson.plan("smoke", 1024, 256)
    assert "16 steps per epoch at 32 per rank x 2 ranks; 2 epochs = 32 steps" in capsys.readouterr().out
    lesson.plan("smoke", 320, 256)
    assert "2 epochs = 10 steps" in capsys.readouterr().out
    with pytest.raises(ValueError, match="TRAIN_SIZE to 320"):
        lesson.plan("smoke", 256, 256)


def test_tidy_shows_packages_and_course_files_as_a_reader_would():
    site = "/opt/env/lib/python3.11/site-packages"
    text = f"{site}/torch/x.py {PROJECT_ROOT}/course/a.py /__w/pytorch/pytorch/third_party/gloo"
    assert lesson.tidy(text, {site}) == "<site-packages>/torch/x.py course/a.py third_party/gloo"


# --- section 1 --------------------------------------------------------------------------------------------------------

RANK1 = "step 7 ...\nFAULT INJECTED: rank 1 exits after step 7\n"
ATTEMPT1 = ("attempt 1: resumed from runs/06_crash/r1/snapshots/snapshot_00000005.pt (step 5, epoch 0)\n"
            "world_size=2 backend=gloo steps=32 attempt=1\nstep 8 loss 2.0\n"
            "done: 32 steps, resumed from 5, restarts 1, sha256 301026e3ad92ff5f\ntest accuracy 0.4766 on 256 images\n")
TRACEBACK = ("Traceback (most recent call last):\n  File \"a.py\", line 1, in <module>\n    x()\n"
             "RuntimeError: [pair.cc:545] Read error: Connection reset by peer.\n")


def test_fault_story_reads_a_traceback_ending():
    story = lesson.fault_story("step 7\n" + TRACEBACK + ATTEMPT1, RANK1)
    assert story.traceback_lines == 4 and story.error.startswith("RuntimeError")
    assert "4-line traceback ending in RuntimeError" in story.ending
    assert story.ended_without_hanging
    assert [line.split()[0] for line in story.attempt1] == ["attempt", "world_size=2", "done:", "test"]


def test_fault_story_accepts_rank0_stopped_before_gloo_raised():
    story = lesson.fault_story("step 7\n" + ATTEMPT1, RANK1)
    assert story.error is None and "no traceback" in story.ending and story.ended_without_hanging


def test_fault_story_says_false_for_another_step_or_a_non_error_ending():
    assert not lesson.fault_story(ATTEMPT1, RANK1.replace("step 7", "step 9")).ended_without_hanging
    assert not lesson.fault_story("Traceback (x)\n  f\nKeyboardInterrupt\n" + ATTEMPT1, RANK1).ended_without_hanging


def test_fault_story_refuses_logs_without_the_fault_or_the_restart():
    with pytest.raises(ValueError):
        lesson.fault_story(ATTEMPT1, "step 7\n")
    with pytest.raises(ValueError):
        lesson.fault_story("step 7\n", RANK1)


def _steps(losses, attempt=0, first=1):
    return [{"kind": "step", "rank": 0, "step": first + i, "loss": x, "attempt": attempt} for i, x in enumerate(losses)]


def _run(tmp_path, name, *, restarts, resumed_from, losses_records, weights, accuracy=0.5, steps=10):
    path = tmp_path / f"{name}.pt"
    torch.save(weights, path)
    result = {"resumed_from": resumed_from, "restart_count": restarts, "steps": steps, "test_accuracy": accuracy,
              "final_params_sha256": "ab" if torch.equal(weights["w"], torch.ones(2)) else "cd",
              "checkpoint": str(path), "world_size": 2}
    return SimpleNamespace(restarts=restarts, result=result, metrics=losses_records)


def test_claim_resume_true_for_a_faithful_resume_false_when_a_loss_or_a_bit_differs(tmp_path, capsys):
    losses = [2.3, 2.2, 2.1, 2.0, 1.9, 1.8, 1.7, 1.6, 1.5, 1.4]
    clean = _run(tmp_path, "clean", restarts=0, resumed_from=None, losses_records=_steps(losses),
                 weights={"w": torch.ones(2)})
    crashed_records = _steps(losses[:7]) + _steps(losses[5:], attempt=1, first=6)
    crashed = _run(tmp_path, "crashed", restarts=1, resumed_from=5, losses_records=crashed_records,
                   weights={"w": torch.ones(2)})
    story = lesson.fault_story("step 7\n" + ATTEMPT1, RANK1)
    lesson.claim_resume(clean, crashed, story)
    got = verdicts(capsys)
    assert len(got) == 7 and all(got.values()), got

    off = _steps(losses[:7]) + _steps([x + 1e-7 for x in losses[5:]], attempt=1, first=6)
    drifted = _run(tmp_path, "drifted", restarts=1, resumed_from=0, losses_records=off,
                   weights={"w": torch.tensor([1.0, 1.0 + 2**-20])})
    lesson.claim_resume(clean, drifted, story)
    got = verdicts(capsys)
    assert not got["after the restart, every loss of rank 0 equals the run without a fault's, step for step"]
    assert not got["final weights bitwise equal (sha256, and torch.equal on every tensor)"]
    assert not got["faulty run: resumed from the newest snapshot before the fault, step 5"]


def test_newest_kept_is_the_last_two_multiples():
    assert lesson.newest_kept(32, 5) == [25, 30]
    assert lesson.newest_kept(10, 5) == [5, 10]
    assert lesson.newest_kept(7, 5) == [5]


def test_claim_snapshots_false_when_an_old_snapshot_was_left(tmp_path, capsys):
    folder = tmp_path / "snapshots"
    for step in (25, 30):
        checkpoint.save_snapshot({"step": step}, folder, step, keep=2)
    run = SimpleNamespace(result={"checkpoint": str(tmp_path / "final_model.pt"), "steps": 32})
    lesson.claim_snapshots(run)
    assert all(verdicts(capsys).values())
    checkpoint.save_snapshot({"step": 20}, folder, 20, keep=3)
    lesson.claim_snapshots(run)
    assert not any(verdicts(capsys).values())


def test_plot_resume_draws_the_reference_and_both_attempts():
    import matplotlib
    matplotlib.use("Agg")
    clean = SimpleNamespace(metrics=_steps([2.0, 1.9, 1.8]))
    crashed = SimpleNamespace(metrics=_steps([2.0, 1.9]) + _steps([1.9, 1.8], attempt=1, first=2))
    import matplotlib.pyplot as plt
    lesson.plot_resume(clean, crashed)
    assert len(plt.gcf().axes[0].lines) == 4  # reference, two attempts, the snapshot's line


# --- section 2 --------------------------------------------------------------------------------------------------------

def test_claim_two_nodes_false_when_the_weights_differ(capsys):
    rec = lambda rank, sha: {"kind": "result", "rank": rank, "world_size": 2, "steps": 32, "resumed_from": None,
                             "final_params_sha256": sha}
    clean = SimpleNamespace(result={"world_size": 2, "final_params_sha256": "ab"})
    two = SimpleNamespace(metrics=[rec(0, "ab"), rec(1, "ab")])
    two.results_by_rank = lambda: {0: rec(0, "ab"), 1: rec(1, "ab")}
    two.result = {"world_size": 2, "final_params_sha256": "ab"}
    lesson.claim_two_nodes(two, clean)
    assert all(verdicts(capsys).values())
    two.result = {"world_size": 2, "final_params_sha256": "cd"}
    lesson.claim_two_nodes(two, clean)
    assert verdicts(capsys) == {"two nodes x 1 rank: world size 2, like the single-node run": True,
                                "same final weights as 1 node x 2 ranks, bit for bit": False}


# --- section 3 --------------------------------------------------------------------------------------------------------

class FakeError(Exception):
    def __init__(self, message, reason, run_dir=None):
        super().__init__(message)
        self.reason, self.run_dir = reason, run_dir


STALLED = ("ranks stalled\n--- Python stack of rank 0 when it stalled ---\n  File \"d.py\", line 1 in all_reduce\n"
           "--- Python stack of rank 1 when it stalled ---\n  File \"d.py\", line 2 in barrier\nrun dir: x\n")


def test_claim_hang_true_for_the_mismatch_false_when_rank1_got_past(tmp_path, capsys):
    (tmp_path / "rank0.log").write_text("rank 0: all_reduce for the log line (rank 1 never joins)\n")
    (tmp_path / "rank1.log").write_text("rank 1: waiting at the barrier\n")
    lesson.claim_hang(FakeError(STALLED, "stalled", tmp_path))
    assert all(verdicts(capsys).values())
    (tmp_path / "rank1.log").write_text("rank 1: waiting at the barrier\nrank 1: past the barrier\n")
    lesson.claim_hang(FakeError(STALLED, "stalled", tmp_path))
    got = verdicts(capsys)
    assert not got["rank 1's last words: waiting at the barrier (never past it); its stack ends inside barrier"]
    (tmp_path / "rank1.log").write_text("rank 1: waiting at the barrier\n")
    lesson.claim_hang(FakeError(STALLED.split("--- Python stack of rank 1")[0], "timeout", tmp_path))
    assert list(verdicts(capsys).values()) == [False, True, False]  # rank 1's stack is missing


def test_show_stacks_prints_from_the_first_stack_to_the_run_dir(capsys):
    lesson.show_stacks(FakeError(STALLED, "stalled"))
    out = capsys.readouterr().out
    assert out.startswith("--- Python stack of rank 0") and "run dir" not in out and "in barrier" in out


def test_claim_fixed_needs_the_mean_loss_and_every_rank_past_the_barrier(capsys):
    logs = {0: "mean loss 1.50\nrank 0: waiting at the barrier\nrank 0: past the barrier\n",
            1: "rank 1: waiting at the barrier\nrank 1: past the barrier\n"}
    run = SimpleNamespace(returncode=0, log=lambda r: logs[r])
    lesson.claim_fixed(run)
    out = capsys.readouterr().out
    assert "rank 0's log: mean loss 1.50 | rank 0: waiting at the barrier" in out and "True" in out
    logs[1] = "rank 1: waiting at the barrier\n"
    lesson.claim_fixed(run)
    assert not any(verdicts(capsys).values())


DETAIL = ("RuntimeError: Detected mismatch between collectives on ranks. Rank 1 is running collective: "
          "CollectiveFingerPrint(SequenceNumber=0OpType=BARRIER), but Rank 0 is running collective: "
          "CollectiveFingerPrint(SequenceNumber=0, OpType=ALLREDUCE)\n")


def test_mismatch_reads_each_ranks_collective_in_both_spellings():
    line, seen = lesson.mismatch(DETAIL)
    assert line.startswith("RuntimeError: Detected mismatch") and seen == [("0", "ALLREDUCE"), ("1", "BARRIER")]
    assert lesson.mismatch("a hang, nothing detected") == (None, [])


def test_claim_detail_false_without_the_mismatch(capsys):
    lesson.claim_detail(FakeError(DETAIL, "failed"))
    assert all(verdicts(capsys).values())
    lesson.claim_detail(FakeError(DETAIL.replace("OpType=ALLREDUCE", "OpType=BROADCAST"), "failed"))
    assert verdicts(capsys)["rank 0 was caught in its ALLREDUCE"] is False
    lesson.claim_detail(FakeError("stalled", "stalled"))
    assert not any(verdicts(capsys).values())


def test_claim_pg_timeout_checks_the_allowed_seconds(capsys):
    err = FakeError("RuntimeError: [unbound_buffer.cc:78] Timed out waiting 8000ms for recv operation", "failed")
    lesson.claim_pg_timeout(err, seconds=8)
    out = capsys.readouterr().out
    assert "default collective timeouts: gloo 0:30:00" in out and out.rstrip().endswith("True")
    lesson.claim_pg_timeout(err, seconds=10)
    assert not any(verdicts(capsys).values())
    assert lesson.first_line(err, "Timed out").startswith("RuntimeError: [unbound_buffer.cc:78]")


def test_claim_port_false_when_the_pinned_launch_ran_or_the_free_one_failed(capsys):
    busy = SimpleNamespace(returncode=1, stdout="", stderr="... EADDRINUSE, message: address already in use\n")
    ran = SimpleNamespace(returncode=0, stdout="ok", stderr="")
    lesson.claim_port(busy, ran)
    assert all(verdicts(capsys).values())
    lesson.claim_port(ran, busy)
    assert not any(verdicts(capsys).values())
