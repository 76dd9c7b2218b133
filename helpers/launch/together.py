"""Independent launches side by side: two at a time on a CPU-only machine, one at a time with GPUs.

A launch spends its first seconds in one process (the launcher importing torch) while the other core waits, and its
ranks spend theirs importing torch and the frameworks. Two launches started together fill those gaps: on the 2-core
machine four 40-step runs of chapter 05 took 26.9 s side by side against 33.5 s one after another (medians of two
rounds each, alternated: benchmarks/bench_side_by_side.py, ratio 0.80). Each run's own steps are slower while the other
runs, so only launches whose *timings* nobody reads may go together: a chapter times its runs one at a time.

With GPUs every launch uses all of them, so launches never overlap there.

Example::

    plain, clipped = launch.side_by_side(lambda: launch.torchrun("train.py", 2, ["--lr", 0.2]),
                                         lambda: launch.torchrun("train.py", 2, ["--lr", 0.2, "--clip", 1.0]))
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import TypeVar

from .machine import Machine

T = TypeVar("T")

_live: set = set()  # sessions followed by side_by_side's threads: a stop press in the main thread kills them
_lock = threading.Lock()


def at_once(machine: Machine | None = None) -> int:
    """How many launches may run together here: 2 on a machine without GPUs and with at least 2 cores, else 1."""
    machine = machine or Machine.detect()
    return 1 if machine.gpus or machine.cpus < 2 else 2


def side_by_side(*launches: Callable[[], T], limit: int | None = None) -> list[T]:
    """Call ``launches`` (callables without arguments, each making one launch), ``limit`` at a time (default
    :func:`at_once`), and return their results in the order given.

    When one fails, the launches not yet started are not started, those running finish, and the first failure
    is raised (a :class:`~helpers.launch.LaunchError` names its run). The stop button kills every run started."""
    if not launches or not all(callable(f) for f in launches):
        raise TypeError("side_by_side takes callables without arguments, e.g. lambda: launch.torchrun(...)")
    limit = at_once() if limit is None else limit
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    if limit == 1:
        return [f() for f in launches]
    pool = ThreadPoolExecutor(max_workers=limit, thread_name_prefix="side_by_side")
    futures = [pool.submit(f) for f in launches]
    try:
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        if any(f.exception() is not None for f in done):
            for f in futures:
                f.cancel()  # not started yet: never started
        wait(futures)
    except BaseException:  # the stop button: kill what runs, start nothing more
        for f in futures:
            f.cancel()
        stop_all()
        pool.shutdown(wait=True)
        raise
    pool.shutdown(wait=True)
    for f in futures:
        if not f.cancelled() and f.exception() is not None:
            raise f.exception()
    return [f.result() for f in futures]


def follow_here(session) -> None:
    """Register a session followed in a thread other than the main one (SIGINT reaches only the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        with _lock:
            _live.add(session)


def forget(session) -> None:
    with _lock:
        _live.discard(session)


def stop_all() -> None:
    """Kill the run of every registered session (their threads then see the run end and raise)."""
    with _lock:
        sessions = list(_live)
    for session in sessions:
        session.kill()
