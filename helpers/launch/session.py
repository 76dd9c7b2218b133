"""One running launcher and its process tree: spawned in a session of its own, its output split into per-rank logs
and streamed, its metrics followed for the progress bar, its limits (timeout, stall) enforced, and every process it
started killed when it ends badly."""
from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from ..rank import metrics as _metrics
from . import warm
from .processes import EXIT_S, _descendants, _parent_watched, _signal_group, _StopButton, kill_run
from .processes import kill_tree  # noqa: F401  (plain.py and the package take it from here)
from .spec import PROJECT_ROOT

# "saved": the output is being saved into a notebook (the course runner and `make nbtest` set it), so it must read
# the same on every run: no progress bar (a saved bar shows the state it was drawn in, 0%), and with show="all" each
# source's lines together, rank 0's, then rank 1's, ..., then the launcher's, instead of in the order they happened
# to arrive. Anything else ("live", the default in JupyterLab): a live bar and lines as they come.
OUTPUT_ENV = "HELPERS_OUTPUT"


def _saved_output() -> bool:
    return os.environ.get(OUTPUT_ENV) == "saved"


def course_relative(text: str) -> str:
    """``text`` with the course root's absolute path dropped from the paths in it: what a cell shows a learner is
    the same on every machine (``runs/x/rank0.log``, ``course/train.py``). The log files keep the full text."""
    return _UNDER_ROOT.sub("", text)


# the root where a path starts, not inside a longer path that happens to contain it
_UNDER_ROOT = re.compile(r"(?<![\w./-])" + re.escape(f"{PROJECT_ROOT}{os.sep}"))

RANK_PREFIX = re.compile(r"^\[rank(\d+)\]:(.*)$")


def stack_in_tail(text: str) -> str | None:
    """The faulthandler dump at the end of a rank's output: from its "Fatal Python error: Aborted" (or, without one,
    its "Current thread") on; None if there is none. Anchored on the last "Current thread", which only a rank's own
    dump writes: ranks dump at once, and the launcher's tee can glue another rank's first line ("[rank0]:Fatal
    Python error: Aborted") onto the end of this rank's last one, where a plain last match would start the stack."""
    thread = text.rfind("Current thread")
    if thread < 0:
        start = text.rfind("Fatal Python error: Aborted")
        return text[start:] if start >= 0 else None
    fatal = text.rfind("Fatal Python error: Aborted", 0, thread)
    return text[fatal if fatal >= 0 else thread:]


class _FileTail:
    """Follows a file another process appends to: each call returns what grew since the last one."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0
        self.partial = b""

    def read(self) -> tuple[bool, list[bytes]]:
        """(whether the file grew, the complete new lines); a line still being written waits for its end."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return False, []
        if not chunk:
            return False, []
        self.offset += len(chunk)
        *complete, self.partial = (self.partial + chunk).split(b"\n")
        return True, complete


class _Session:
    """One running launcher: reads its output, tails logs and metrics, enforces limits."""

    def __init__(self, cmd, env, run_dir: Path, nproc: int, show: str, rank_log_dir: Path | None):
        self.run_dir = run_dir
        self.nproc = nproc
        self.show = show
        self.rank_log_dir = rank_log_dir  # deepspeed: ranks write their own files here
        # line-buffered, so `tail -f runs/.../rank1.log` follows a live run
        self.rank_files = {r: open(run_dir / f"rank{r}.log", "a", buffering=1) for r in range(nproc)}
        self.launcher_log = open(run_dir / "launcher.log", "a", buffering=1)
        self.tails: dict[int, list[str]] = {r: [] for r in range(nproc)}
        self.first_traceback: dict[int, float] = {}
        self.launcher_tail: list[str] = []
        self.lines: queue.Queue = queue.Queue()
        # saved output with several sources shown: lines held per source and printed grouped by flush_shown()
        self.held: dict[int | str, list[str]] | None = {} if show == "all" and _saved_output() else None
        self.metrics_tail = _FileTail(run_dir / _metrics.METRICS_FILE)
        self.progress = None
        self.first_step = 0
        self.total_steps = None
        self.known: dict[int, psutil.Process] = {}
        self.stacks: dict[int, str] = {}
        self.start = time.monotonic()
        self.last_activity = self.start
        # the stall clock starts at the ranks' first sign of life: interpreter start-up and `import torch`
        # (seconds, more on a busy machine) are not a stall; `timeout` bounds them
        self.alive = False
        self.status = "running"  # until follow() says how the run ended
        self.rank_file_tails: dict[Path, _FileTail] = {}
        self.launcher: psutil.Process | None = None
        # held until follow() listens: a press while Popen waits for the exec must not leave the launcher unknown
        self.stop_button = _StopButton()
        self.proc = None
        try:
            # forked from a server that has imported torch already (helpers/launch/warm.py), else a fresh interpreter
            self.proc = warm.start(cmd, env, str(PROJECT_ROOT)) or subprocess.Popen(
                _parent_watched(cmd), env=env, cwd=str(PROJECT_ROOT), stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
            try:
                self.launcher = psutil.Process(self.proc.pid)
            except psutil.Error:
                pass  # already gone: follow() reads its output and exit code
            self.reader = threading.Thread(target=self._read_pipe, daemon=True)
            self.reader.start()
        except BaseException:
            if self.proc is not None:  # started, but nobody will follow it
                _signal_group(self.proc.pid, signal.SIGKILL)
            self.stop_button.restore(deliver=False)
            raise

    # -- input
    def _read_pipe(self) -> None:
        for raw in iter(self.proc.stdout.readline, b""):
            self.lines.put(raw.decode("utf-8", "replace").rstrip("\n"))
        self.lines.put(None)

    def _rank_line(self, rank: int, text: str) -> None:
        own = f"[rank{rank}]:"  # torch prefixes uncaught errors itself; one prefix is enough
        if text.startswith(own):
            text = text[len(own):].removeprefix(" ")
        if rank not in self.rank_files:  # an elastic restart can bring new ranks
            self.rank_files[rank] = open(self.run_dir / f"rank{rank}.log", "a", buffering=1)
            self.tails[rank] = []
        self.rank_files[rank].write(text + "\n")
        self.alive = True
        tail = self.tails[rank]
        tail.append(text)
        del tail[:-40]
        if "Traceback (most recent call last)" in text:
            self.first_traceback.setdefault(rank, time.monotonic())
        if self.show == "all" or (self.show == "rank0" and rank == 0):
            self._print(f"[rank{rank}] {text}", source=rank)

    def _launcher_line(self, text: str) -> None:
        self.launcher_log.write(text + "\n")
        self.launcher_tail.append(text)
        del self.launcher_tail[:-80]
        if self.show == "all":
            self._print(f"[launcher] {text}", source="launcher")

    def _print(self, text: str, source: int | str | None = None, flush: bool = True) -> None:
        text = course_relative(text)
        if self.held is not None and source is not None:
            self.held.setdefault(source, []).append(text)
        elif self.progress is not None:
            self.progress.write(text)
        else:
            print(text, flush=flush)

    def _drain_pipe(self, wait: float) -> bool:
        """Handle queued launcher lines; False once the pipe is closed."""
        deadline = time.monotonic() + wait
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return True
            if line is None:
                return False
            self.last_activity = time.monotonic()
            m = RANK_PREFIX.match(line)
            if m:
                self._rank_line(int(m.group(1)), m.group(2))
            else:
                self._launcher_line(line)

    def _tail_rank_files(self) -> None:
        """deepspeed's launcher writes ``<stamp>_rank<k>.log`` files; follow them."""
        if self.rank_log_dir is None or not self.rank_log_dir.exists():
            return
        for path in self.rank_log_dir.glob("*_rank*.log"):
            m = re.search(r"_rank(\d+)\.log$", path.name)
            if not m:
                continue
            grew, lines = self.rank_file_tails.setdefault(path, _FileTail(path)).read()
            if grew:
                self.last_activity = time.monotonic()
            for line in lines:
                self._rank_line(int(m.group(1)), line.decode("utf-8", "replace"))

    def _read_metrics(self) -> None:
        grew, lines = self.metrics_tail.read()
        if not grew:
            return
        self.last_activity = time.monotonic()
        self.alive = True
        for line in lines:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            self._on_metric(rec)

    def _on_metric(self, rec: dict) -> None:
        if rec.get("rank") != 0 or self.show == "none":
            return
        if rec.get("kind") == "total":
            self.total_steps, self.first_step = rec.get("steps"), rec.get("start", 0)
            self._open_progress()
        elif rec.get("kind") == "step" and self.progress is not None:
            # steps are numbered from 1 (helpers.rank.metrics): step k of a run resumed after step `start` is the
            # (k - start)-th of this run, so the bar ends full on the last step
            done = min(rec.get("step", 0) - self.first_step, self.total_steps or 0)
            if done > self.progress.n:
                self.progress.update(done - self.progress.n)
            if "loss" in rec:
                self.progress.set_postfix(loss=f"{rec['loss']:.4f}", refresh=False)

    def _open_progress(self) -> None:
        if self.progress is not None or not self.total_steps or _saved_output():
            return
        try:
            from tqdm.auto import tqdm
            self.progress = tqdm(total=self.total_steps, desc="rank 0 steps", unit="step",
                                 leave=True, mininterval=0.5)
        except Exception:  # pragma: no cover - progress is a nicety
            self.progress = None

    def _remember_processes(self) -> None:
        for p in _descendants(self.proc.pid):
            self.known.setdefault(p.pid, p)

    # -- control
    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def dump_stacks(self, script: Path, wait: float = 2.0) -> dict[int, str]:
        """Make every rank print its Python stack (faulthandler, on SIGABRT) and collect it from its log.

        Only rank processes get the signal, never the launcher, so the dumps still flow through its tee."""
        self._remember_processes()
        ranks = []
        for p in self.known.values():
            try:
                cmd = p.cmdline()
                launcher = any("torch.distributed.run" in c or "deepspeed.launcher" in c for c in cmd)
                if str(script) in cmd and not launcher and p.pid != self.proc.pid:
                    ranks.append(p)
            except psutil.Error:
                continue
        for p in ranks:
            try:
                p.send_signal(signal.SIGABRT)
            except psutil.Error:
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            self._drain_pipe(0.1)
            self._tail_rank_files()
        stacks = {}
        for rank, tail in self.tails.items():
            stack = stack_in_tail("\n".join(tail))
            if stack is not None:
                stacks[rank] = stack
        return stacks

    def follow(self, script: Path, timeout, stall_timeout) -> None:
        """Follow the run until the launcher exits, ``timeout`` passes or the ranks stall; ``status`` then says which
        ("ok", "failed", "timeout", "stalled"). Unless the run succeeded, every process of it is killed, also when
        a KeyboardInterrupt ("interrupted") or any other exception ("error") stops the wait, which then propagates."""
        try:
            self.stop_button.listen()  # a press while the launcher started is a KeyboardInterrupt now
            open_ = True
            tick = 0
            while True:
                open_ = self._drain_pipe(0.05) if open_ else (time.sleep(0.05) or False)
                self._tail_rank_files()
                self._read_metrics()
                if tick % 10 == 0:
                    self._remember_processes()
                tick += 1
                if not open_ and self._launcher_exited():
                    break
                if timeout is not None and self.elapsed() > timeout:
                    self.status = "timeout"
                    break
                if stall_timeout is not None and self.alive and time.monotonic() - self.last_activity > stall_timeout:
                    self.status = "stalled"
                    break
            if self.status == "stalled":
                self.stacks = self.dump_stacks(script)
            if self.status != "running":
                self.kill()
            else:
                self._tail_rank_files()
                self._read_metrics()
                self.status = "ok" if self.proc.returncode == 0 else "failed"
                if self.status == "failed":
                    self.kill()  # a launcher that died oddly may leave ranks behind
        except KeyboardInterrupt:
            self.status = "interrupted"
            self.kill()
            raise
        except BaseException:
            self.status = "error"
            self.kill()
            raise

    def _launcher_exited(self) -> bool:
        """``Popen.poll``, with presses held: a KeyboardInterrupt raised inside it can keep Popen's wait lock (2 in
        ~11,000 presses on a loop of polls), after which a wait for the launcher without a timeout blocks for ever."""
        listening = self.stop_button.hold()
        try:
            return self.proc.poll() is not None
        finally:
            if listening:
                self.stop_button.listen()

    def kill(self) -> None:
        """Kill every process of the run (:func:`~helpers.launch.processes.kill_run`: the tree frozen first, then
        killed), in a second or so and ``FREEZE_S + 2 * EXIT_S`` at most, whatever state they are in; a stop pressed
        meanwhile waits for the end (and, unless the kill answers one, is raised then). Our own child is reaped by
        ``Popen.wait``, never by psutil: psutil reaping it first would leave ``Popen`` a return code of 0 for a run it
        killed."""
        listening = self.stop_button.hold()
        kill_run(self.proc.pid, self.launcher, self.known.values(), self.run_dir)
        try:
            self.proc.wait(timeout=EXIT_S)  # bounded: never blocks on a wait lock an interrupted poll() kept
        except subprocess.TimeoutExpired:
            pass  # not exited 2 s after SIGKILL (uninterruptible I/O): its return code stays unknown
        if listening:  # a kill for a timeout, stall or failure: a press meanwhile is a KeyboardInterrupt now
            self.stop_button.listen()

    def flush_shown(self) -> None:
        """Print the lines held for a saved output: each rank's in rank order, then the launcher's."""
        if not self.held:
            return
        held, self.held = self.held, None
        for source in sorted(k for k in held if k != "launcher") + ["launcher"]:
            for text in held.get(source, []):
                self._print(text, flush=False)  # one flush for all: in a kernel each waits on its I/O thread
        sys.stdout.flush()

    def close(self) -> None:
        self.flush_shown()
        if self.progress is not None:
            self.progress.close()
            self.progress = None
        for f in self.rank_files.values():
            f.close()
        self.launcher_log.close()
        # presses after the first (or before follow() listened) were answered by the kill; one that came as the run
        # ended well is answered now
        self.stop_button.restore(deliver=self.status == "ok")
