"""A script run the way a learner types ``python script.py`` in a terminal, without a launcher of ours in between:
for scripts whose point is what they do on their own (the blog's self-relaunching ``__main__``), run safely.

The script starts in a session of its own; whatever it starts (a launcher, ranks, further launchers) is followed
through the process tree and killed when ``timeout`` passes, and anything still running when the script itself
ends is killed too, so nothing outlives the call.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from .environment import _new_run_dir
from .session import _descendants, course_relative, kill_tree
from .spec import PROJECT_ROOT


@dataclass
class PlainRun:
    """How a plain ``python script`` run ended: ``output`` is stdout and stderr together (also in ``output.log`` in
    ``run_dir``), ``timed_out`` whether ``timeout`` ended it, ``processes`` how many processes it started in all."""
    returncode: int
    output: str
    timed_out: bool
    duration_s: float
    processes: int
    run_dir: Path


def python(script, args=(), *, env=None, timeout: float, name: str | None = None) -> PlainRun:
    """Run ``python <script> <args>`` from the course root, at most ``timeout`` seconds, and kill its whole process
    tree at the end. ``env`` adds variables to this process's environment."""
    path = Path(script) if Path(script).is_absolute() else PROJECT_ROOT / script
    if not path.is_file():
        raise FileNotFoundError(f"no such script: {script}")
    if not timeout or timeout <= 0:
        raise ValueError("timeout must be a positive number of seconds: a plain run has no stall detection")
    run_dir = _new_run_dir(name or path.stem)
    full_env = {**os.environ, **{k: str(v) for k, v in (env or {}).items()}}
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, str(path), *map(str, args)], cwd=str(PROJECT_ROOT), env=full_env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    seen: dict[int, psutil.Process] = {}
    chunks: list[bytes] = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: proc.stdout.read(4096), b"")), daemon=True)
    reader.start()
    timed_out = False
    def remember():  # every process the tree has had, kept from its first sighting
        seen.update({p.pid: p for p in _descendants(proc.pid) if p.pid not in seen})

    while proc.poll() is None:
        remember()
        if time.monotonic() - start > timeout:
            timed_out = True
            break
        time.sleep(0.1)
    remember()
    if proc.poll() is None:  # the script first, so that it starts nothing more; by Popen, which keeps its exit code
        proc.terminate()
        try:
            proc.wait(timeout=3)
        except subprocess.TimeoutExpired:
            proc.kill()
    kill_tree([p for pid, p in seen.items() if pid != proc.pid])
    proc.wait()
    reader.join(timeout=5)
    output = b"".join(chunks).decode("utf-8", "replace")
    (run_dir / "output.log").write_text(output)
    return PlainRun(returncode=proc.returncode, output=course_relative(output), timed_out=timed_out,
                    duration_s=time.monotonic() - start, processes=len(seen), run_dir=run_dir)
