"""The warm launcher (helpers/launch/warm.py): a fork of a server that imported torch answers as the fresh
interpreter it replaces would, and nothing outlives the process that launched. The launches of the slow tier and of
every notebook go through it; benchmarks/bench_launcher.py times it against ``HELPERS_WARM_LAUNCH=0``."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from helpers.launch import warm


def _fork(code: str, *args, env=None, cwd="/") -> warm.WarmProcess:
    proc = warm.start([sys.executable, "-c", code, *args], dict(os.environ) if env is None else env, cwd)
    assert isinstance(proc, warm.WarmProcess), "the warm server did not answer"
    return proc


def _run(code: str, *args, **kw) -> tuple[int, str]:
    proc = _fork(code, *args, **kw)
    out = proc.stdout.read().decode()
    return proc.wait(timeout=30), out


@pytest.fixture(scope="module", autouse=True)
def server():
    if not warm.enabled():
        pytest.skip("warm launches are off here (HELPERS_WARM_LAUNCH=0, or no Unix fd passing)")
    warm.warm_up(wait=True)


def test_a_fork_sees_its_own_arguments_directory_and_environment(tmp_path):
    env = dict(os.environ, COURSE_PROBE="42", PYTHONUNBUFFERED="1")
    code, out = _run("import os, sys; print(sys.argv, os.getcwd(), os.environ['COURSE_PROBE'], 'torch' in sys.modules,"
                     " sys.stdout.write_through, __name__)", "--flag", "x", env=env, cwd=str(tmp_path))
    assert code == 0
    assert out.strip() == f"['-c', '--flag', 'x'] {tmp_path} 42 True True __main__"  # torch: imported by the server


def test_python_u_is_unbuffered_as_deepspeeds_launcher_is_started():
    proc = warm.start([sys.executable, "-u", "-c", "import sys; print(sys.stdout.write_through)"],
                      {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}, "/")
    assert proc.stdout.read().decode().strip() == "True" and proc.wait(timeout=10) == 0


def test_exit_codes_are_those_of_a_fresh_interpreter():
    assert _run("import sys; sys.exit(3)")[0] == 3
    assert _run("import sys; sys.exit()")[0] == 0
    code, out = _run("import sys; sys.exit('bad input')")
    assert (code, out.strip()) == (1, "bad input")
    code, out = _run("def f():\n    raise ValueError('boom')\nf()")
    assert code == 1 and out.startswith("Traceback") and "ValueError: boom" in out
    assert "warm.py" not in out  # the traceback starts at the command, as python -c prints it
    assert _run("import os, signal; os.kill(os.getpid(), signal.SIGTERM)")[0] == -signal.SIGTERM


def test_a_fork_leads_its_own_session_and_can_be_waited_for_with_a_timeout():
    proc = _fork("import os, time; print(os.getpid() == os.getsid(0) == os.getpgid(0), flush=True); time.sleep(30)")
    assert proc.stdout.readline().decode().strip() == "True"
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # as kill_run does: the launcher's group
    assert proc.wait(timeout=10) == -signal.SIGKILL


def test_what_the_fork_cannot_reproduce_gets_a_fresh_interpreter(monkeypatch):
    env = dict(os.environ, LOGLEVEL="INFO" if os.environ.get("LOGLEVEL") != "INFO" else "DEBUG")
    assert warm.start([sys.executable, "-c", "pass"], env, "/") is None  # read when torch's launcher is imported
    assert warm.start([sys.executable, "-m", "helpers.launch.nodes"], dict(os.environ), "/") is None
    assert warm.start(["torchrun", "x.py"], dict(os.environ), "/") is None
    monkeypatch.setenv(warm.ENV_SWITCH, "0")
    assert warm.start([sys.executable, "-c", "pass"], dict(os.environ), "/") is None


def test_the_server_and_its_launchers_die_with_the_process_that_launched(tmp_path):
    """A kernel killed outright (a restart): the server it started kills every launcher it forked, with their
    children, and leaves; nothing waits for a parent that is gone."""
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import os, sys, time
        from helpers.launch import warm
        warm.warm_up(wait=True)
        code = "import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); print(c.pid, flush=True); time.sleep(60)"
        p = warm.start([sys.executable, '-c', code], dict(os.environ), '/')
        print(p.pid, p.stdout.readline().decode().strip(), warm._server.proc.pid, flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        launcher, child, server = map(int, parent.stdout.readline().split())
        assert all(psutil.pid_exists(p) for p in (launcher, child, server))
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(p) for p in (launcher, child, server)):
        time.sleep(0.1)
    assert not any(_alive(p) for p in (launcher, child, server))


def test_a_launch_never_waits_for_a_server_still_importing_torch():
    """The first launch of a process finds its server still starting: it is told to start a fresh interpreter at
    once (a press of the stop button would otherwise wait out the server's import of torch), and a later launch, once
    the server is ready, is forked from it."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import os, sys, time
        from helpers.launch import warm
        t = time.monotonic()
        first = warm.start([sys.executable, '-c', 'pass'], dict(os.environ), '/')
        took = time.monotonic() - t
        ready = warm.warm_up(wait=True)
        later = warm.start([sys.executable, '-c', 'pass'], dict(os.environ), '/')
        print(first is None, f"{took:.2f}", ready, later is not None and later.wait(timeout=30) == 0)
    """)], capture_output=True, text=True, timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    first_cold, took, ready, later_warm = out.stdout.split()
    assert (first_cold, ready, later_warm) == ("True", "True", "True"), out.stderr
    assert float(took) < 0.5, f"the first launch waited {took}s for the server"


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
