"""The stop button, pressed at any moment of a launch on a busy machine: the cell gives the kernel back within 5 s and
nothing of the run is left.

A driver process (tests/scripts/interrupt_driver.py) plays the kernel: each line it reads launches
tests/scripts/steps.py on 2 CPU ranks, and SIGINT raises KeyboardInterrupt in it as the stop button does. Two busy
loops load this machine's cores while each press lands: while the launcher starts, while the ranks start and meet,
mid-training (also pressed again and again while the first press is being answered), and as the ranks finish. After
each launch, while the driver waits, every process seen in its tree, every PID a rank printed, every process of the
run's sessions and every process whose environment names the run directory must be gone. Last, the driver is killed
outright mid-run, as a kernel restart does: the run must still end.
"""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from helpers.launch import warm
from helpers.launch.processes import _StopButton
from helpers.launch.spec import PROJECT_ROOT
from helpers.rank import metrics
from test_launch_faults import _alive, processes_of_run, rank_pids

RETURN_S = 5.0  # the bound: from a press to the launch giving control back


@contextmanager
def busy_cores(n: int = 2):
    """``n`` processes spinning on a core each, for as long as the block runs."""
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in loops:
            p.kill()
        for p in loops:
            p.wait()


class Driver:
    """The driver process, its output lines and every process seen below it."""

    def __init__(self, runs_root: Path, log: Path):
        env = dict(os.environ, HELPERS_RUNS_DIR=str(runs_root), HELPERS_OUTPUT="live")
        self.runs_root = runs_root
        self.stderr = open(log, "w")
        self.proc = subprocess.Popen([sys.executable, "tests/scripts/interrupt_driver.py"], cwd=PROJECT_ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True)
        self.lines: queue.Queue = queue.Queue()
        self.seen: dict[int, psutil.Process] = {}
        self.done = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._watch, daemon=True).start()
        self.expect("ready", timeout=120)

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                self.lines.put(line[3:].split())

    def _watch(self) -> None:
        me = psutil.Process(self.proc.pid)
        while not self.done.is_set():
            try:
                for p in me.children(recursive=True):
                    self.seen.setdefault(p.pid, p)
            except psutil.Error:
                pass
            time.sleep(0.02)

    def expect(self, word: str, timeout: float) -> list[str]:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            self.proc.send_signal(signal.SIGUSR1)  # where it is stuck, into its log
            time.sleep(1)
            raise AssertionError(f"the driver said nothing for {timeout}s (waiting for {word!r}); its stacks are in "
                                 f"{self.stderr.name}") from None
        assert line[0] == word, line
        return line

    def go(self, steps: int) -> int:
        self.seen.clear()
        self.proc.stdin.write(f"go {steps}\n")
        self.proc.stdin.flush()
        return int(self.expect("launching", timeout=30)[1])

    def run_dir(self, i: int) -> Path | None:
        dirs = list((self.runs_root / f"interrupt{i}").glob("*"))
        return dirs[0] if dirs else None

    def ranks(self) -> list[psutil.Process]:
        """The rank processes seen so far: children of the torchrun agent, running the script."""
        found = []
        for p in list(self.seen.values()):
            try:
                cmd = " ".join(p.cmdline())
                if "steps.py" in cmd and "torch.distributed.run" not in cmd and _alive(p):
                    found.append(p)
            except psutil.Error:
                continue
        return found

    def close(self) -> None:
        self.done.set()
        try:
            self.proc.stdin.write("exit\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.stderr.close()


def wait_until(condition, what: str, timeout: float = 120.0, every: float = 0.01):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = condition()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"never saw {what} within {timeout}s")


def steps_reached(run_dir: Path | None, step: int) -> bool:
    if run_dir is None:
        return False
    reached = {r["rank"] for r in metrics.steps(metrics.read_metrics(run_dir)) if r["step"] >= step}
    return reached >= {0, 1}


def finished_ranks(run_dir: Path | None) -> bool:
    return run_dir is not None and len([r for r in metrics.read_metrics(run_dir) if r.get("kind") == "result"]) >= 1


def press(driver: Driver, again_after: tuple[float, ...] = ()) -> float:
    """SIGINT to the driver, then once more at each of ``again_after`` seconds later; when the first was sent."""
    sent = time.monotonic()
    driver.proc.send_signal(signal.SIGINT)
    for t in again_after:
        time.sleep(max(0.0, sent + t - time.monotonic()))
        driver.proc.send_signal(signal.SIGINT)
    return sent


def assert_nothing_left(driver: Driver, run_dir: Path | None) -> None:
    """Every process of the run is gone (a zombie counts as gone: it has exited, its parent has yet to reap it)."""
    # the warm launcher's server lives as long as the driver (helpers/launch/warm.py); the launchers it forks do not
    seen = [p for p in driver.seen.values() if p.pid != driver.proc.pid and not warm.is_server(p)]
    left = [(p.pid, p.name()) for p in seen if _alive(p)]
    assert not left, f"processes started by the launch still alive: {left}"
    if run_dir is None:
        return
    printed = [pid for pids in rank_pids(run_dir).values() for pid in pids]
    sessions = {p.pid for p in seen} | set(printed)  # the agent and every rank lead a session of their own
    in_sessions = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) in sessions and _alive(p):
                in_sessions.append((p.pid, p.name()))
        except (OSError, psutil.Error):
            continue
    assert not in_sessions, f"processes in the run's sessions still alive: {in_sessions}"
    leftovers = processes_of_run(run_dir)
    assert not leftovers, f"processes of {run_dir} still alive: {[(p.pid, p.cmdline()) for p in leftovers]}"


# (name, steps the launch would run, when to press, presses again after the first)
MOMENTS = [
    ("launcher starting", 100_000, "run_dir", ()),
    ("ranks starting and meeting", 100_000, "ranks", ()),
    ("training, pressed four times", 100_000, "step", (0.02, 0.06, 0.15)),
    ("ranks finishing", 40, "finished", (0.1,)),
]


@pytest.mark.slow
def test_stop_button_returns_within_5s_and_leaves_nothing(tmp_path):
    runs_root = tmp_path / "runs"
    driver = Driver(runs_root, tmp_path / "driver.log")
    timings = []
    try:
        for name, steps, moment, again in MOMENTS:
            i = driver.go(steps)
            if moment == "run_dir":  # env.json is written just before the launcher is started
                wait_until(lambda: (driver.run_dir(i) or tmp_path / "none") .joinpath("env.json").exists(),
                           "the run's env.json")
            elif moment == "ranks":
                wait_until(lambda: len(driver.ranks()) == 2, "two rank processes")
                assert not steps_reached(driver.run_dir(i), 0), "the ranks were already training"
            else:
                wait_until(lambda: steps_reached(driver.run_dir(i), 1), "both ranks at step 1", every=0.05)
            with busy_cores(2):
                if moment == "step":
                    wait_until(lambda: steps_reached(driver.run_dir(i), 3), "both ranks at step 3", every=0.02)
                elif moment == "finished":
                    wait_until(lambda: finished_ranks(driver.run_dir(i)), "a rank's result record", every=0.005)
                sent = press(driver, again)
                _, _, outcome, returned = driver.expect("returned", timeout=60)
            took = float(returned) - sent
            timings.append(f"{name}: {outcome} after {took:.2f}s")
            assert took < RETURN_S, f"{name}: the launch gave control back {took:.1f}s after the press"
            if moment != "finished":
                assert outcome == "interrupted", name
            time.sleep(0.2)  # a zombie's parent reaps it (the driver for the agent, init for orphaned ranks)
            assert_nothing_left(driver, driver.run_dir(i))
        if sys.platform.startswith("linux"):
            # The kernel killed, not interrupted (a restart, the OOM killer): nothing in it can kill the run, but the
            # launcher is told of its parent's death (PR_SET_PDEATHSIG) and stops its ranks itself.
            i = driver.go(100_000)
            wait_until(lambda: steps_reached(driver.run_dir(i), 1), "both ranks at step 1", every=0.05)
            driver.proc.kill()
            driver.proc.wait()
            wait_until(lambda: not any(_alive(p) for p in list(driver.seen.values()) if p.pid != driver.proc.pid),
                       "every process of the run gone after the driver was killed", timeout=15, every=0.1)
            assert_nothing_left(driver, driver.run_dir(i))
    finally:
        driver.close()
        print("\n".join(timings))


def test_presses_wait_while_the_launcher_starts_and_while_a_run_is_killed():
    """The rule the test above holds a real launch to, on the session's SIGINT handler alone: a press is a
    KeyboardInterrupt only while the run is followed; one while the launcher starts is raised once following begins;
    after that first one, presses wait (the kill they would cut short is running), and are dropped at the end."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # what a kernel runs a cell with
    try:
        button = _StopButton()  # as a session starts its launcher
        signal.raise_signal(signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            button.listen()  # follow() begins
        signal.raise_signal(signal.SIGINT)  # pressed again while the kill runs: nothing raised
        assert button.presses == 1
        button.restore(deliver=False)  # the session closes; the first press is on its way already
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

        button = _StopButton()
        button.listen()
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)  # mid-run: at once
        button.restore(deliver=False)
    finally:
        signal.signal(signal.SIGINT, previous)
