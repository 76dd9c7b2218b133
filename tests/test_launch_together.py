"""launch.side_by_side: independent launches two at a time on a CPU, in-process with stand-in launches (the
chapters' own launches prove it end to end under nbval; benchmarks/bench_side_by_side.py times it)."""
import threading
import time

import pytest

from helpers import launch
from helpers.launch import together
from helpers.launch.machine import Machine


def test_two_at_a_time_only_without_gpus():
    assert together.at_once(Machine(gpus=0, cpus=2)) == 2
    assert together.at_once(Machine(gpus=0, cpus=16)) == 2
    assert together.at_once(Machine(gpus=0, cpus=1)) == 1
    assert together.at_once(Machine(gpus=4, cpus=64)) == 1  # every launch uses all the GPUs


class Meter:
    """Stand-in launches that record how many ran at once, and in which thread."""

    def __init__(self):
        self.lock, self.now, self.most, self.started, self.threads = threading.Lock(), 0, 0, [], set()

    def job(self, i, seconds=0.05, fail=False):
        def go():
            with self.lock:
                self.now += 1
                self.most = max(self.most, self.now)
                self.started.append(i)
                self.threads.add(threading.current_thread().name)
            time.sleep(seconds)
            with self.lock:
                self.now -= 1
            if fail:
                raise launch.LaunchError(f"run {i} failed")
            return i * 10
        return go


@pytest.mark.parametrize("limit", [1, 2, 3])
def test_results_in_order_and_never_more_than_the_limit_at_once(limit):
    m = Meter()
    assert launch.side_by_side(*(m.job(i, 0.02 * (5 - i)) for i in range(5)), limit=limit) == [0, 10, 20, 30, 40]
    assert m.most == limit and sorted(m.started) == list(range(5))
    if limit == 1:  # one at a time: in the caller's own thread, where the stop button reaches the launch
        assert m.threads == {threading.current_thread().name}


def test_a_failure_is_raised_and_stops_what_has_not_started():
    m = Meter()
    with pytest.raises(launch.LaunchError, match="run 0 failed"):
        launch.side_by_side(m.job(0, 0.01, fail=True), m.job(1, 0.3), m.job(2), m.job(3), limit=2)
    assert 1 in m.started and 3 not in m.started  # the running one finished; the queue was dropped


def test_a_stop_press_kills_every_run_started(monkeypatch):
    release = threading.Event()
    killed = []

    class Session:  # what _launch registers: a run followed in another thread
        def __init__(self, i):
            self.i = i

        def kill(self):
            killed.append(self.i)
            release.set()

    def job(i):
        def go():
            s = Session(i)
            together.follow_here(s)
            try:
                if not release.wait(10):
                    raise AssertionError("never killed")
                raise launch.LaunchError(f"run {i} killed")
            finally:
                together.forget(s)
        return go

    real_wait = together.wait
    calls = []

    def pressed(futures, **kw):  # the stop button, pressed while the main thread waits
        calls.append(1)
        if len(calls) == 1:
            deadline = time.monotonic() + 5
            while len(together._live) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            raise KeyboardInterrupt
        return real_wait(futures, **kw)

    monkeypatch.setattr(together, "wait", pressed)
    with pytest.raises(KeyboardInterrupt):
        launch.side_by_side(job(0), job(1), job(2), limit=2)
    assert sorted(set(killed)) == [0, 1] and not together._live  # run 2 never started


def test_refuses_what_is_not_a_launch():
    with pytest.raises(TypeError, match=r"callables without arguments, e.g. lambda: launch.torchrun"):
        launch.side_by_side("course/ddp_tuning.py")  # a script, not a launch
    with pytest.raises(TypeError, match="callables without arguments"):
        launch.side_by_side()
    with pytest.raises(ValueError, match="at least 1"):
        launch.side_by_side(lambda: 1, limit=0)
