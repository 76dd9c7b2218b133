"""The processes of a run as the launcher controls them: the tree below it found, frozen and killed in bounded time,
the stop button (SIGINT) answered only where that can happen, and a launcher that ends its run if its starter dies.

Every wait here is bounded: a kill never waits for a PID to disappear (an orphaned rank stays a zombie until some
init reaps it) and never waits without a timeout.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Iterable

import psutil

from ..rank import metrics as _metrics


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        parent = psutil.Process(pid)
        return [parent] + parent.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


# Stopping a run is bounded, whatever state its processes are in: a stopped cell gives the kernel back within seconds
# (tests/test_launch_interrupt.py holds it under 5 s on a loaded 2-core machine, a second stop press included).
FREEZE_S = 0.5  # at most, for the processes of a run to stop (SIGSTOP) before their children are listed
EXIT_S = 2.0    # at most, for killed processes to exit; a process that has not by then is left to the kernel


def _gone(p: psutil.Process) -> bool:
    """Whether ``p`` has exited. A zombie has: a rank orphaned by its launcher's death stays one until the machine's
    init process reaps it -- a second or two on some machines, never in a container whose PID 1 does not reap --
    and waiting for its PID to disappear (``psutil.wait_procs``) made every kill wait on someone else's reaper."""
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False


def _stopped(p: psutil.Process) -> bool:
    try:
        return _gone(p) or p.status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False


def _wait_for(procs: Iterable[psutil.Process], done, timeout: float) -> list[psutil.Process]:
    """Poll until ``done(p)`` holds for every process or ``timeout`` passes; the processes it does not hold for."""
    deadline = time.monotonic() + timeout
    left = list(procs)
    while True:
        left = [p for p in left if not done(p)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.01)


def _signal(p: psutil.Process, sig: int) -> None:
    try:
        p.send_signal(sig)  # psutil refuses a PID that now belongs to another process
    except psutil.Error:
        pass


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _children(p: psutil.Process) -> list[psutil.Process]:
    try:
        return p.children() if p.is_running() else []  # is_running: never the children of a reused PID
    except psutil.Error:
        return []


def kill_tree(procs: Iterable[psutil.Process], grace: float = 3.0) -> None:
    """SIGTERM every process, SIGKILL what has not exited ``grace`` seconds later; returns once all have exited
    (``EXIT_S`` at most after the SIGKILL), without waiting for anyone to reap them."""
    procs = list(procs)
    for p in procs:
        _signal(p, signal.SIGTERM)
    alive = _wait_for(procs, _gone, grace)
    for p in alive:
        _signal(p, signal.SIGKILL)
    _wait_for(alive, _gone, EXIT_S)


class _StopButton:
    """SIGINT (the kernel's stop button) for the life of one launch, answered only where the launch can kill what it
    started: a first press while the run is followed is a KeyboardInterrupt there; any press while the launcher is
    being started, or while the run is being killed (after a first press, say), waits until that is done. Else a press
    at the wrong moment left a launcher running that nobody knew of, or cut a kill short and left ranks running.

    Only in the main thread (the only one SIGINT reaches) and only when a Python handler is installed
    (``default_int_handler``, which raises KeyboardInterrupt); an ignored SIGINT stays ignored."""

    def __init__(self):
        self.previous = None
        self.presses = 0       # presses not yet answered
        self.holding = True    # from the start: the launcher is about to be started
        if threading.current_thread() is threading.main_thread():
            previous = signal.getsignal(signal.SIGINT)
            if callable(previous):
                signal.signal(signal.SIGINT, self._pressed)
                self.previous = previous

    def _pressed(self, signum, frame) -> None:
        if self.holding:
            self.presses += 1
            return
        try:
            self.previous(signum, frame)
        except BaseException:
            self.holding = True  # a KeyboardInterrupt, answered by a kill: a later press waits for it
            raise

    def hold(self) -> bool:
        """Hold presses from now on; whether they were answered before (so that ``listen`` can be called after)."""
        was, self.holding = not self.holding, True
        return was

    def listen(self) -> None:
        """Answer presses from now on, a held one first (KeyboardInterrupt, raised here)."""
        if self.previous is None:
            return
        self.holding = False
        if self.presses:
            self.presses = 0
            self._pressed(signal.SIGINT, None)

    def restore(self, deliver: bool) -> None:
        """Give SIGINT its handler back; a press still held is answered there when ``deliver``."""
        if self.previous is None:
            return
        previous, self.previous = self.previous, None
        signal.signal(signal.SIGINT, previous)
        if deliver and self.presses:
            self.presses = 0
            previous(signal.SIGINT, None)


# The launcher runs with a watch on the process that started it. A kernel restarted or killed (not interrupted) has no
# chance to kill anything, and its launcher, in a session of its own, would go on training with nobody to read it.
# So a thread in the launcher's own process looks for its parent twice a second; once the parent is gone it kills
# every process below (the ranks, in sessions of their own, and theirs) and ends the launcher. Not a SIGTERM the
# launcher would handle itself: torchrun's handling of it stops the ranks but can hang afterwards. A launcher forked by
# the warm server (helpers/launch/warm.py) runs the same watch on the server, which watches the kernel.
WATCH_PARENT = """
import os, sys, threading, time
def watch(parent):
    while os.getppid() == parent:
        time.sleep(0.5)
    import psutil
    for _ in range(3):
        for p in psutil.Process().children(recursive=True):
            try:
                p.kill()
            except psutil.Error:
                pass
        time.sleep(0.05)
    os._exit(1)
"""
_PARENT_WATCH = WATCH_PARENT + """
threading.Thread(target=watch, args=(int(sys.argv[1]),), daemon=True, name="parent-watch").start()
mode, target, *rest = sys.argv[2:]
if mode == "-c":
    import __main__
    sys.argv = ["-c", *rest]
    exec(compile(target, "<string>", "exec"), __main__.__dict__)
else:
    import runpy
    sys.argv = [target, *rest]
    runpy.run_module(target, run_name="__main__", alter_sys=True)
"""


def _parent_watched(cmd: list[str]) -> list[str]:
    """``cmd`` (``python -c CODE ...`` or ``python -m MODULE ...``, as every launcher of ours is started) run with the
    watch on this process; any other command unchanged."""
    if os.name != "posix" or len(cmd) < 3 or cmd[0] != sys.executable or cmd[1] not in ("-c", "-m"):
        return list(cmd)
    return [sys.executable, "-c", _PARENT_WATCH, str(os.getpid()), *cmd[1:]]


def kill_run(group: int, launcher: psutil.Process | None, known: Iterable[psutil.Process], run_dir: Path) -> None:
    """SIGKILL every process of a run whose launcher leads process group ``group``, and wait (``EXIT_S`` at most) for
    them to exit; the launcher itself is left to its ``Popen`` to reap.

    Nothing may start while this runs: first the launcher's process group is stopped (SIGSTOP), so that it can
    neither restart the ranks it would see dying nor start one not yet seen, then each generation below it, parents
    before their children are listed. Ranks run in sessions of their own, so they are found through the process tree
    (and in ``known``, the ones seen during the run, whose launcher may have died), not by process group; a process of
    the run outside both is found by ``run_dir`` in its environment."""
    procs: list[psutil.Process] = []
    try:
        procs = _freeze(group, launcher, known)
        procs += _strays(launcher, run_dir, {p.pid for p in procs})
    finally:
        _signal_group(group, signal.SIGKILL)
        for p in procs:
            if p.pid != group:
                _signal(p, signal.SIGKILL)
    _wait_for(procs, _gone, EXIT_S)


def _freeze(group: int, launcher: psutil.Process | None, known: Iterable[psutil.Process]) -> list[psutil.Process]:
    """Stop the launcher's process group, then every process below it and every one remembered, generation by
    generation; all of them, stopped (or exited) unless one took longer than ``FREEZE_S`` in all."""
    _signal_group(group, signal.SIGSTOP)
    frozen: dict[int, psutil.Process] = {}
    level = ([launcher] if launcher is not None else []) + list(known)
    deadline = time.monotonic() + FREEZE_S
    while level:
        level = list({p.pid: p for p in level if p.pid not in frozen}.values())
        for p in level:
            frozen[p.pid] = p
            if p.pid != group:  # the launcher's group is stopped already
                _signal(p, signal.SIGSTOP)
        _wait_for(level, _stopped, max(0.0, deadline - time.monotonic()))
        level = [c for p in level for c in _children(p)]
    return list(frozen.values())


def _strays(launcher: psutil.Process | None, run_dir: Path, seen: set[int]) -> list[psutil.Process]:
    """Processes of the run that left its tree unseen (their parent died first): started since the launcher and
    carrying this run's directory in their environment. The start time leaves few environments to read."""
    if launcher is None:
        return []
    try:
        since = launcher.create_time() - 0.05
    except psutil.Error:
        return []
    found = []
    for p in psutil.process_iter(["create_time"]):
        if p.pid in seen or p.pid == os.getpid() or (p.info.get("create_time") or 0.0) < since:
            continue
        try:
            if p.environ().get(_metrics.RUN_DIR_ENV) == str(run_dir):
                found.append(p)
        except (psutil.Error, OSError):
            continue
    return found
