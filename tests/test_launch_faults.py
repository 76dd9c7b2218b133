"""Fault injection for helpers.launch: every way a run can go wrong ends in one clean place.

Each test launches real torchrun runs of tests/scripts/steps.py (or fail_once.py) on 2 CPU ranks and
checks two things: the error the notebook user sees, and that nothing is left running afterwards.

Rank processes run in their own session (torchrun starts them with start_new_session=True), so once
torchrun is gone they are no longer our descendants. Survivors are therefore found three ways: new
descendants of this process, the PIDs the ranks printed (``pid=<pid> rank=<r> start``), and any
process on the machine whose environment points at the run directory.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import threading
import time
from pathlib import Path

import psutil
import pytest

from helpers import launch
from helpers.rank import metrics
from helpers.launch import LaunchError

STEPS = "tests/scripts/steps.py"
FAIL_ONCE = "tests/scripts/fail_once.py"


# ---------------------------------------------------------------------------------------------
# helpers


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def rank_pids(run_dir: Path) -> dict[int, list[int]]:
    """PIDs every rank printed in its log (``pid=<pid> rank=<r>``), one per attempt."""
    out: dict[int, list[int]] = {}
    for log in sorted(run_dir.glob("rank*.log")):
        for pid, rank in re.findall(r"pid=(\d+) rank=(\d+)", log.read_text()):
            out.setdefault(int(rank), []).append(int(pid))
    return out


def processes_of_run(run_dir: Path) -> list[psutil.Process]:
    """Live processes anywhere on the machine whose environment names this run directory."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(metrics.RUN_DIR_ENV) == str(run_dir) and _alive(p):
                found.append(p)
        except (psutil.Error, OSError):
            continue
    return found


def assert_no_survivors(run_dir: Path | None, children_before: set[int], expect_ranks=(0, 1)) -> None:
    """Nothing the launch started is still running: no new descendant, no rank PID, no process of the run."""
    new_children = [p for p in psutil.Process().children(recursive=True)
                    if p.pid not in children_before and _alive(p)]
    assert not new_children, f"launcher children still alive: {new_children}"
    if run_dir is None:
        return
    pids = rank_pids(run_dir)
    for rank in expect_ranks:
        for pid in pids.get(rank, []):
            if psutil.pid_exists(pid):
                proc = psutil.Process(pid)
                assert not _alive(proc) or proc.environ().get(metrics.RUN_DIR_ENV) != str(run_dir), \
                    f"rank {rank} (pid {pid}) survived the launch"
    leftovers = processes_of_run(run_dir)
    assert not leftovers, f"processes of {run_dir} still alive: {[(p.pid, p.cmdline()) for p in leftovers]}"


def result_json(run_dir: Path) -> dict:
    return json.loads((run_dir / "result.json").read_text())


def only_run_dir(root: Path) -> Path:
    dirs = [d for d in root.glob("*/*") if d.is_dir()]
    assert len(dirs) == 1, dirs
    return dirs[0]


def when_ranks_reach(root: Path, step: int, action, done: threading.Event, ranks=(0, 1),
                     deadline_s: float = 120.0) -> threading.Thread:
    """Call ``action()`` from a thread once every rank has reported ``step`` in metrics.jsonl.

    metrics.jsonl is written unbuffered by the ranks themselves, so it shows progress as it happens.
    ``done`` (set by the test when the launch has returned) keeps a late ``action`` from firing."""
    def watch():
        end = time.monotonic() + deadline_s
        while time.monotonic() < end and not done.is_set():
            for d in root.glob("*/*"):
                reached = {r["rank"] for r in metrics.steps(metrics.read_metrics(d)) if r["step"] >= step}
                if set(ranks) <= reached:
                    if not done.is_set():
                        action()
                    return
            time.sleep(0.1)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


# ---------------------------------------------------------------------------------------------
# a rank fails


@pytest.mark.slow
@pytest.mark.parametrize("fault_rank", [1, 0])
def test_crashed_rank_is_named_in_error(runs_root, children_before, fault_rank):
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch.torchrun(STEPS, nproc=2, show="none", timeout=120,
                        env={"FAULT_RANK": fault_rank, "FAULT_STEP": 2, "FAULT_KIND": "raise", "STEPS": 50})
    elapsed = time.monotonic() - start
    e = info.value
    # ordering, not speed: the crash ended the run, long before the 120 s timeout could have
    assert elapsed < 120 / 2, f"a crash took {elapsed:.1f}s to surface"
    assert e.reason == "failed"
    assert e.rank == fault_rank
    assert e.exitcode not in (0, None)
    assert f"injected fault on rank {fault_rank} at step 2" in str(e)
    assert "Traceback" in str(e)
    assert str(e.run_dir) in str(e)
    outcome = result_json(e.run_dir)
    assert outcome["status"] == "failed"
    assert outcome["failed_rank"] == fault_rank
    assert outcome["exitcode"] == e.exitcode
    assert set(rank_pids(e.run_dir)) == {0, 1}
    assert_no_survivors(e.run_dir, children_before)


@pytest.mark.slow
def test_hard_exit_of_rank_is_named_with_its_exit_code(runs_root, children_before):
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch.torchrun(STEPS, nproc=2, show="none", timeout=120,
                        env={"FAULT_RANK": 1, "FAULT_STEP": 2, "FAULT_KIND": "exit", "STEPS": 50})
    e = info.value
    assert time.monotonic() - start < 120 / 2  # the exit ended the run, long before the timeout could have
    assert e.reason == "failed"
    assert e.rank == 1
    assert e.exitcode == 3
    assert "exit code 3" in str(e)
    outcome = result_json(e.run_dir)
    assert (outcome["status"], outcome["failed_rank"], outcome["exitcode"]) == ("failed", 1, 3)
    assert set(rank_pids(e.run_dir)) == {0, 1}
    assert_no_survivors(e.run_dir, children_before)


# ---------------------------------------------------------------------------------------------
# a rank hangs, the run takes too long


@pytest.mark.slow
def test_hung_rank_ends_as_stalled_and_every_rank_is_killed(runs_root, children_before):
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch.torchrun(STEPS, nproc=2, show="none", stall_timeout=5, timeout=120,
                        env={"FAULT_RANK": 1, "FAULT_STEP": 2, "FAULT_KIND": "hang", "STEPS": 50})
    e = info.value
    assert time.monotonic() - start < 120 / 2  # the 5 s stall limit ended it, long before the timeout could have
    assert e.reason == "stalled"
    assert "stalled" in str(e)
    assert result_json(e.run_dir)["status"] == "stalled"
    # No rank PID in the logs is enough here: with stall_timeout=5 the (silent) start-up can itself
    # trip the stall on a loaded 2-core machine; the test below pins a stall caused by the hang.
    assert_no_survivors(e.run_dir, children_before)


@pytest.mark.slow
def test_stall_after_a_rank_hangs_mid_run_shows_the_hang(runs_root, children_before):
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch.torchrun(STEPS, nproc=2, show="none", stall_timeout=15, timeout=120,
                        env={"FAULT_RANK": 1, "FAULT_STEP": 2, "FAULT_KIND": "hang", "STEPS": 50})
    e = info.value
    assert time.monotonic() - start < 120 / 2  # the 15 s stall limit ended it, long before the timeout could have
    assert e.reason == "stalled"
    assert "rank 1 hanging at step 2" in str(e)  # the last output of each rank is in the message
    assert "rank 1 hanging at step 2" in (e.run_dir / "rank1.log").read_text()
    pids = rank_pids(e.run_dir)
    assert set(pids) == {0, 1}
    assert_no_survivors(e.run_dir, children_before)


@pytest.mark.slow
def test_run_over_timeout_is_killed_with_reason_timeout(runs_root, children_before):
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch.torchrun(STEPS, nproc=2, show="none", timeout=10, env={"STEPS": 1000, "STEP_S": 0.05})
    elapsed = time.monotonic() - start
    e = info.value
    assert 10 <= elapsed < 1000 * 0.05  # the 10 s timeout ended it, long before its 1000 steps of 0.05 s would have
    assert e.reason == "timeout"
    assert e.rank is None
    assert "timeout=10" in str(e)
    assert result_json(e.run_dir)["status"] == "timeout"
    # Rank PIDs are not required here: on a loaded machine start-up alone can take most of the 10 s.
    # Whatever started (logged PIDs, processes of the run dir) must be gone.
    assert_no_survivors(e.run_dir, children_before)


@pytest.mark.slow
def test_killed_run_records_a_nonzero_returncode(runs_root, children_before):
    with pytest.raises(LaunchError) as info:
        launch.torchrun(STEPS, nproc=2, show="none", timeout=6, env={"STEPS": 1000, "STEP_S": 0.05})
    try:
        assert info.value.reason == "timeout"
        assert result_json(info.value.run_dir)["returncode"] != 0
    finally:
        assert_no_survivors(info.value.run_dir, children_before)


@pytest.mark.slow
def test_rank_logs_are_written_while_the_run_is_going(runs_root, children_before):
    done = threading.Event()
    seen = {}

    def peek():
        run_dir = only_run_dir(runs_root)
        seen["log"] = (run_dir / "rank1.log").read_text()
        seen["finished"] = (run_dir / "result.json").exists()

    # Step 20: the line looked for was printed 18 steps (0.9 s) earlier. Lines reach rankN.log through torchrun's
    # log tailing (every 0.1 s) and the launcher's pipe, while the metrics that fire this are written directly.
    when_ranks_reach(runs_root, 20, peek, done)
    try:
        run = launch.torchrun(STEPS, nproc=2, show="none", timeout=120, env={"STEPS": 100, "STEP_S": 0.05})
    finally:
        done.set()
    try:
        assert "log" in seen, "the ranks never got to step 20"
        assert not seen["finished"]  # the run was still going
        assert "rank 1 step 2 sum=3" in seen["log"]
    finally:
        assert_no_survivors(run.run_dir, children_before)


# ---------------------------------------------------------------------------------------------
# the user stops the cell; the launcher itself dies


@pytest.mark.slow
def test_keyboard_interrupt_propagates_and_kills_every_rank(runs_root, children_before):
    done = threading.Event()
    sent = []

    def interrupt():
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)

    # Fire once both ranks are past step 10 (truly mid-run, and their start-up lines with the PIDs have long
    # reached the launcher), like the stop button would.
    when_ranks_reach(runs_root, 10, interrupt, done)
    # A kernel turns SIGINT into KeyboardInterrupt; a test process started in the background by a non-interactive
    # shell inherits SIGINT ignored, and Python then never installs that handler.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            launch.torchrun(STEPS, nproc=2, show="none", timeout=120, env={"STEPS": 1000, "STEP_S": 0.05})
        stopped = time.monotonic()
    finally:
        done.set()
        signal.signal(signal.SIGINT, previous)
    assert sent, "the interrupt was never sent"
    assert stopped - sent[0] < 5, "the launcher took too long to give the interrupt back"
    run_dir = only_run_dir(runs_root)
    assert set(rank_pids(run_dir)) == {0, 1}
    outcome = result_json(run_dir)
    assert outcome["status"] == "interrupted"
    assert_no_survivors(run_dir, children_before)


@pytest.mark.slow
def test_killed_launcher_process_raises_and_leaves_no_orphan_ranks(runs_root, children_before):
    done = threading.Event()

    def kill_torchrun():  # the ranks' parent: a fresh interpreter or a fork of the warm server (launch/warm.py)
        for p in psutil.Process().children(recursive=True):
            if str(STEPS) in " ".join(p.cmdline()):
                p.parent().kill()
                return

    when_ranks_reach(runs_root, 10, kill_torchrun, done)  # late enough that the PID lines were forwarded
    start = time.monotonic()
    try:
        with pytest.raises(LaunchError) as info:
            launch.torchrun(STEPS, nproc=2, show="none", timeout=120, env={"STEPS": 1000, "STEP_S": 0.05})
    finally:
        done.set()
    e = info.value
    assert time.monotonic() - start < 120 / 2  # the kill ended it, long before the timeout could have
    assert e.reason == "failed"
    assert e.exitcode == -signal.SIGKILL
    assert set(rank_pids(e.run_dir)) == {0, 1}
    assert_no_survivors(e.run_dir, children_before)


# ---------------------------------------------------------------------------------------------
# the machine is not pristine


@pytest.mark.slow
def test_busy_default_port_29500_does_not_matter(runs_root, children_before):
    blocker = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        try:
            blocker.bind(("", 29500))
            blocker.listen(1)
        except OSError as err:
            pytest.skip(f"cannot occupy port 29500 for the test: {err}")
        run = launch.torchrun(STEPS, nproc=2, show="none", timeout=120, env={"STEPS": 3})
    finally:
        blocker.close()
    assert run.returncode == 0
    assert run.result["steps_done"] == 3
    recorded = json.loads((run.run_dir / "env.json").read_text())
    assert recorded["port"] != 29500
    assert run.port == recorded["port"]
    assert_no_survivors(run.run_dir, children_before)


# ---------------------------------------------------------------------------------------------
# elastic restarts


def attempts(run_dir: Path) -> int:
    """How many times torchrun started the worker group (one elastic/<id>/attempt_<n> dir each)."""
    return len(list(run_dir.glob("elastic/*/attempt_*")))


@pytest.mark.slow
def test_max_restarts_recovers_from_one_failure(runs_root, children_before):
    run = None
    try:
        run = launch.torchrun(FAIL_ONCE, nproc=2, show="none", timeout=60, max_restarts=1)
        assert run.returncode == 0
        assert (run.run_dir / "failed_once.marker").exists(), "the first attempt never failed"
        assert attempts(run.run_dir) == 2
        assert run.result["attempt"] == 1  # the result comes from the restarted attempt
        assert run.restarts >= 1
        assert result_json(run.run_dir)["restarts"] == run.restarts
    finally:
        assert_no_survivors(run.run_dir if run else only_run_dir(runs_root), children_before)


@pytest.mark.slow
def test_failure_after_restarts_are_used_up_is_reported(runs_root, children_before):
    # rank 1 raises on every attempt: one restart, then the failure surfaces with rank 1 named
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch.torchrun(FAIL_ONCE, nproc=2, show="none", timeout=60, max_restarts=1, env={"FAIL_MODE": "always"})
    e = info.value
    assert time.monotonic() - start < 60  # the used-up restart ended it, not the 60 s timeout (reason "timeout")
    assert e.reason == "failed"
    assert e.rank == 1
    assert e.exitcode not in (0, None)
    assert "planned failure of rank 1 on attempt" in str(e)
    assert attempts(e.run_dir) == 2  # it was restarted once before giving up
    assert len(rank_pids(e.run_dir)[1]) == 2
    assert_no_survivors(e.run_dir, children_before)


def test_free_port_avoids_the_ephemeral_range():
    """gloo's outgoing connections take source ports from the kernel's ephemeral range; a master port from that
    range can be taken between the pick and rank 0's bind (seen as EADDRINUSE when two runs overlapped)."""
    low, high = launch._ephemeral_port_range()
    if low <= 10001:
        pytest.skip(f"this machine's ephemeral range starts at {low}: no port below it to choose (the OS picks)")
    ports = {launch.free_port() for _ in range(20)}
    assert all(not low <= p <= high for p in ports), (ports, low, high)
    assert len(ports) > 1  # random, so concurrent launchers rarely pick the same one


def test_free_port_skips_ports_in_use():
    machine = launch.Machine(gpus=0, cpus=2, ephemeral_ports=(10003, 60999))  # candidates 10000-10002
    blockers = []
    try:
        for port in (10000, 10002):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            blockers.append(s)
            try:
                s.bind(("127.0.0.1", port))
                s.listen(1)
            except OSError as err:
                pytest.skip(f"cannot occupy port {port} for the test: {err}")
        try:
            socket.create_server(("127.0.0.1", 10001)).close()
        except OSError as err:
            pytest.skip(f"port 10001 is busy on this machine: {err}")
        assert {launch.free_port(machine=machine) for _ in range(10)} == {10001}
    finally:
        for s in blockers:
            s.close()


def test_a_rank_s_stack_is_its_own_dump_even_when_another_rank_s_first_line_is_glued_to_its_end():
    """Seen in CI (notebook 06's hang): both ranks dump at once and the tee glued rank 0's "Fatal Python error"
    onto rank 1's last line; taking the last match started rank 1's stack there, and lost its frames."""
    from helpers.launch.session import stack_in_tail

    tail = ("rank 1: waiting at the barrier\nFatal Python error: Aborted\n\nCurrent thread 0x7f (most recent call "
            "first):\n  File \"torch/distributed/distributed_c10d.py\", line 6371 in barrier\n  File \"x.py\", line 47 "
            "in main\n\nExtension modules: torch._C[rank0]:Fatal Python error: Aborted\n (total: 21)")
    stack = stack_in_tail(tail)
    assert stack.startswith("Fatal Python error: Aborted\n\nCurrent thread") and "in barrier" in stack
    assert stack_in_tail("Current thread 0x1:\n  File \"a.py\", line 1 in f").startswith("Current thread")
    assert stack_in_tail("no dump here") is None
