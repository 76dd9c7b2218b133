"""Launch real multi-process runs from a notebook cell, safely.

Every rank is a process of the standard launcher (``torchrun`` or ``deepspeed``), started as a
subprocess in its own session. The notebook kernel never forks, never spawns ranks itself and
never initialises CUDA, so a crashed or hung run cannot poison the kernel.

Example::

    from helpers import launch
    run = launch.torchrun("course/allreduce_check.py", nproc=2)
    run.result            # merged ``Reporter.result`` records of the ranks
    run.log(1)            # everything rank 1 printed

On failure a :class:`LaunchError` names the failing rank and shows its traceback. Timeouts,
stalls (no output and no metric for ``stall_timeout`` seconds), a crashed rank and a
KeyboardInterrupt (the notebook's stop button) all end in the same place: the whole process tree
is killed and nothing is left running.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import queue
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

import psutil

from . import metrics as _metrics
from .env import cpu_count, default_backend, default_nproc, gpu_count

PROJECT_ROOT = Path(__file__).resolve().parent.parent
RANK_PREFIX = re.compile(r"^\[rank(\d+)\]:(.*)$")
_run_counter = itertools.count()
_SHOW_CHOICES = ("rank0", "all", "none")


class LaunchError(Exception):
    """A launched run failed, timed out, stalled or could not start.

    Attributes: ``rank`` (the failing rank, or None when the whole run was stopped),
    ``exitcode`` (that rank's exit code, or None), ``run_dir`` (where its logs are),
    ``reason`` ("failed", "timeout", "stalled", "invalid").
    """

    def __init__(self, message: str, *, rank: int | None = None, exitcode: int | None = None,
                 run_dir: Path | None = None, reason: str = "failed"):
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode
        self.run_dir = run_dir
        self.reason = reason


@dataclass
class Run:
    """The outcome of one launch; everything is also on disk under ``run_dir``."""

    run_dir: Path
    returncode: int
    duration_s: float
    command: list[str]
    nproc: int
    backend: str
    port: int
    restarts: int = 0
    nnodes: int = 1
    _metrics: list[dict] | None = field(default=None, repr=False)

    @property
    def metrics(self) -> list[dict]:
        """All records the ranks wrote with :class:`helpers.metrics.Reporter`."""
        if self._metrics is None:
            self._metrics = _metrics.read_metrics(self.run_dir)
        return self._metrics

    @property
    def result(self) -> dict:
        """The ranks' ``Reporter.result`` records merged (rank 0 wins on conflicts)."""
        return _metrics.results(self.metrics)

    def results_by_rank(self) -> dict[int, dict]:
        out: dict[int, dict] = {}
        for r in self.metrics:
            if r.get("kind") == "result":
                out.setdefault(r["rank"], {}).update({k: v for k, v in r.items() if k not in ("kind", "t", "rank")})
        return dict(sorted(out.items()))

    def log(self, rank: int | str = 0) -> str:
        """Everything one rank printed (``rank="launcher"`` for the launcher's own output)."""
        path = self.run_dir / (f"rank{rank}.log" if rank != "launcher" else "launcher.log")
        return path.read_text() if path.exists() else ""


# ---------------------------------------------------------------------------------------------
# input checks, done before anything starts


def runs_root() -> Path:
    """Where run directories go: ``$HELPERS_RUNS_DIR`` or ``<project>/runs``."""
    return Path(os.environ.get("HELPERS_RUNS_DIR", PROJECT_ROOT / "runs"))


def _resolve_script(script) -> Path:
    if not isinstance(script, (str, os.PathLike)):
        raise LaunchError(f"script must be a path, got {type(script).__name__}", reason="invalid")
    path = Path(script)
    candidates = [path] if path.is_absolute() else [Path.cwd() / path, PROJECT_ROOT / path]
    for c in candidates:
        if c.is_file():
            return c.resolve()
    tried = ", ".join(str(c) for c in candidates)
    raise LaunchError(f"script not found: {script} (looked at {tried}). Paths are relative to the "
                      f"current directory or the course root {PROJECT_ROOT}.", reason="invalid")


def _visible_gpus(extra_env: Mapping[str, str]) -> int:
    """GPUs the ranks will see: none when the caller hides them with ``env={"CUDA_VISIBLE_DEVICES": ""}``."""
    return 0 if extra_env.get("CUDA_VISIBLE_DEVICES", None) == "" else gpu_count()


def _check_nproc(nproc, gpus: int) -> int:
    if nproc is None:
        return default_nproc() if gpus == gpu_count() else 2  # GPUs hidden: CPU ranks, as on a CPU machine
    if isinstance(nproc, bool) or not isinstance(nproc, int):
        raise LaunchError(f"nproc must be a whole number of processes, got {nproc!r} "
                          f"({type(nproc).__name__})", reason="invalid")
    if nproc < 1:
        raise LaunchError(f"nproc must be at least 1, got {nproc}", reason="invalid")
    if gpus and nproc > gpus:
        raise LaunchError(f"nproc={nproc} but this machine has {gpus} GPU(s): one rank per GPU. "
                          f"Use nproc<={gpus}, or hide the GPUs (CUDA_VISIBLE_DEVICES='') to run "
                          f"{nproc} CPU ranks with gloo.", reason="invalid")
    if not gpus and nproc > 8 * cpu_count():
        raise LaunchError(f"nproc={nproc} CPU ranks on {cpu_count()} cores would thrash; "
                          f"use at most {8 * cpu_count()}.", reason="invalid")
    return nproc


def _check_args(args) -> list[str]:
    if isinstance(args, (str, bytes)):
        raise LaunchError(f"args must be a list such as ['--epochs', '1'], not one string {args!r} "
                          f"(use shlex.split if you have a command line)", reason="invalid")
    if isinstance(args, Mapping):
        raise LaunchError("args must be a list of strings; turn a dict into ['--key', 'value', ...]",
                          reason="invalid")
    try:
        items = list(args)
    except TypeError:
        raise LaunchError(f"args must be a list of strings, got {type(args).__name__}", reason="invalid") from None
    out = []
    for a in items:
        if isinstance(a, bool) or not isinstance(a, (str, int, float, os.PathLike)):
            raise LaunchError(f"each argument must be a string, number or path; got {a!r} "
                              f"({type(a).__name__})", reason="invalid")
        out.append(os.fspath(a) if isinstance(a, os.PathLike) else str(a))
    return out


def _check_script_flags(arg_list: list[str]) -> None:
    """torchrun's parser accepts abbreviations of its own options even after the script name, so a script flag
    such as ``--n`` or ``--nproc`` is taken as an ambiguous torchrun option and the launch dies. Refuse it here."""
    from torch.distributed.run import get_args_parser

    options = {o for action in get_args_parser()._actions for o in action.option_strings if o.startswith("--")}
    for a in arg_list:
        flag = a.split("=", 1)[0]
        if flag.startswith("--") and flag not in options and any(o.startswith(flag) for o in options):
            clash = sorted(o for o in options if o.startswith(flag))[:3]
            raise LaunchError(f"script flag {flag} is the start of torchrun's own option(s) {', '.join(clash)}; "
                              f"torchrun would take it as an abbreviation and fail. Rename the flag in the script "
                              f"(e.g. --num-samples instead of --n).", reason="invalid")


def _check_env(env) -> dict[str, str]:
    if env is None:
        return {}
    if not isinstance(env, Mapping):
        raise LaunchError(f"env must be a dict of strings, got {type(env).__name__}", reason="invalid")
    return {str(k): str(v) for k, v in env.items()}


def _check_timeouts(timeout, stall_timeout) -> None:
    for label, value in (("timeout", timeout), ("stall_timeout", stall_timeout)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value <= 0):
            raise LaunchError(f"{label} must be a positive number of seconds or None, got {value!r}",
                              reason="invalid")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now, so a busy 29500 never matters.

    Between this check and the moment rank 0 (or the torchrun agent) binds the port, seconds pass. A port from the
    kernel's ephemeral range could meanwhile become the source port of any outgoing connection -- gloo opens many --
    and the run would die with EADDRINUSE. So the port comes from just below that range, which the kernel never
    hands out on its own; only where no such range exists does the OS pick one."""
    eph_low, _ = _ephemeral_port_range()
    candidates = range(max(10000, eph_low - 12000), eph_low)
    rng = random.SystemRandom()  # forked or concurrent callers must not walk the same sequence
    for port in rng.sample(candidates, min(64, len(candidates))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_port_range() -> tuple[int, int]:
    """The kernel's range for automatically chosen source ports (Linux default 32768-60999)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 49152, 65535  # the IANA dynamic range, which macOS and Windows use


def _new_run_dir(name: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = runs_root() / name / f"{stamp}-{os.getpid()}-{next(_run_counter)}"
    run_dir.mkdir(parents=True, exist_ok=False)
    return run_dir


def rank_env(nproc: int, run_dir: Path, extra: Mapping[str, str]) -> tuple[dict[str, str], str]:
    """The environment every rank inherits: backend, accelerator, threads, run dir."""
    backend = default_backend() if _visible_gpus(extra) else "gloo"
    env = dict(os.environ)
    env.update({
        _metrics.RUN_DIR_ENV: str(run_dir),
        "PYTHONUNBUFFERED": "1",
        # a rank that gets SIGABRT (the launcher sends it to hung ranks) prints every thread's Python stack
        "PYTHONFAULTHANDLER": "1",
        # ranks of a restarted group must not reuse the previous attempt's rendezvous store
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "HELPERS_BACKEND": backend,
        # ranks share the cores: without this each rank starts one OpenMP thread per core
        "OMP_NUM_THREADS": str(max(1, cpu_count() // nproc)),
    })
    if backend != "nccl":
        env["DS_ACCELERATOR"] = "cpu"
    elif env.get("DS_ACCELERATOR") == "cpu" and "DS_ACCELERATOR" not in extra:
        env["DS_ACCELERATOR"] = "cuda"  # the kernel set cpu for DeepSpeed's estimators; ranks with GPUs use them
    env.update(extra)
    return env, backend


# ---------------------------------------------------------------------------------------------
# the process tree


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        parent = psutil.Process(pid)
        return [parent] + parent.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def kill_tree(procs: Iterable[psutil.Process], grace: float = 3.0) -> None:
    """SIGTERM every process, SIGKILL what is still alive after ``grace`` seconds."""
    procs = [p for p in procs]
    for p in procs:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=grace)


# ---------------------------------------------------------------------------------------------
# the launch itself


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
        self.metrics_tail = _FileTail(run_dir / _metrics.METRICS_FILE)
        self.progress = None
        self.total_steps = None
        self.known: dict[int, psutil.Process] = {}
        self.stacks: dict[int, str] = {}
        self.start = time.monotonic()
        self.last_activity = self.start
        # the stall clock starts at the ranks' first sign of life: interpreter start-up and `import torch`
        # (seconds, more on a busy machine) are not a stall; `timeout` bounds them
        self.alive = False
        self.proc = subprocess.Popen(cmd, env=env, cwd=str(PROJECT_ROOT), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        self.reader = threading.Thread(target=self._read_pipe, daemon=True)
        self.reader.start()
        self.rank_file_tails: dict[Path, _FileTail] = {}

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
            self._print(f"[rank{rank}] {text}")

    def _launcher_line(self, text: str) -> None:
        self.launcher_log.write(text + "\n")
        self.launcher_tail.append(text)
        del self.launcher_tail[:-80]
        if self.show == "all":
            self._print(f"[launcher] {text}")

    def _print(self, text: str) -> None:
        if self.progress is not None:
            self.progress.write(text)
        else:
            print(text, flush=True)

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
            self.total_steps = rec.get("steps")
            self._open_progress()
        elif rec.get("kind") == "step" and self.progress is not None:
            done = min(rec.get("step", 0) + 1, self.total_steps or 0)
            if done > self.progress.n:
                self.progress.update(done - self.progress.n)
            if "loss" in rec:
                self.progress.set_postfix(loss=f"{rec['loss']:.4f}", refresh=False)

    def _open_progress(self) -> None:
        if self.progress is not None or not self.total_steps:
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
            text = "\n".join(tail)
            start = max(text.rfind("Fatal Python error: Aborted"), text.rfind("Current thread"))
            if start >= 0:
                stacks[rank] = text[start:]
        return stacks

    def kill(self) -> None:
        """Kill the launcher first (so it cannot restart the ranks it sees dying), then every rank we know of.

        Ranks run in sessions of their own, so they are found by the process tree remembered during the run,
        not by process group. Our own child is reaped by ``Popen.wait``, never by psutil: psutil reaping it
        first would leave ``Popen`` a return code of 0 for a run it killed."""
        self._remember_processes()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        kill_tree([p for pid, p in self.known.items() if pid != self.proc.pid])
        self.proc.wait()

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
            self.progress = None
        for f in self.rank_files.values():
            f.close()
        self.launcher_log.close()


def _launch(kind: str, cmd_for, script, nproc, args, env, timeout, stall_timeout, name, show, nnodes=1,
            precheck=None) -> Run:
    script_path = _resolve_script(script)
    arg_list = _check_args(args)
    extra_env = _check_env(env)
    nproc = _check_nproc(nproc, _visible_gpus(extra_env))
    if nnodes > 1 and nproc * nnodes > 8 * cpu_count():
        raise LaunchError(f"{nnodes} nodes x {nproc} ranks on {cpu_count()} cores would thrash", reason="invalid")
    if precheck is not None:
        precheck(nproc * nnodes)
    _check_timeouts(timeout, stall_timeout)
    if show not in _SHOW_CHOICES:
        raise LaunchError(f"show must be one of {_SHOW_CHOICES}, got {show!r}", reason="invalid")

    run_dir = _new_run_dir(name or script_path.stem)
    rank_env_, backend = rank_env(nproc * nnodes, run_dir, extra_env)
    port = free_port()
    cmd, rank_log_dir = cmd_for(script_path, nproc, arg_list, port, run_dir)
    record = {"kind": kind, "script": str(script_path), "args": arg_list, "nproc": nproc, "nnodes": nnodes,
              "backend": backend,
              "port": port, "command": cmd, "omp_num_threads": rank_env_["OMP_NUM_THREADS"],
              "ds_accelerator": rank_env_.get("DS_ACCELERATOR"), "python": sys.executable,
              "gpus": _visible_gpus(extra_env), "cpus": cpu_count(), "started": time.time()}
    (run_dir / "env.json").write_text(json.dumps(record, indent=2))

    session = _Session(cmd, rank_env_, run_dir, nproc, show, rank_log_dir)
    status, error = "running", None
    try:
        open_ = True
        tick = 0
        while True:
            open_ = session._drain_pipe(0.05) if open_ else (time.sleep(0.05) or False)
            session._tail_rank_files()
            session._read_metrics()
            if tick % 10 == 0:
                session._remember_processes()
            tick += 1
            if session.proc.poll() is not None and not open_:
                break
            if timeout is not None and session.elapsed() > timeout:
                status = "timeout"
                break
            if stall_timeout is not None and session.alive and time.monotonic() - session.last_activity > stall_timeout:
                status = "stalled"
                break
        if status == "stalled":
            session.stacks = session.dump_stacks(script_path)
        if status != "running":
            session.kill()
        else:
            session._tail_rank_files()
            session._read_metrics()
            status = "ok" if session.proc.returncode == 0 else "failed"
            if status == "failed":
                session.kill()  # a launcher that died oddly may leave ranks behind
    except KeyboardInterrupt:
        status = "interrupted"
        session.kill()
        raise
    except BaseException:
        status = "error"
        session.kill()
        raise
    finally:
        duration = session.elapsed()
        session.close()
        if status != "ok" and status != "running":
            error = _error_for(status, session, script_path, timeout, stall_timeout)
        returncode = session.proc.returncode if session.proc.returncode is not None else -1
        restarts = max(0, _attempts(run_dir) - 1)
        outcome = {"status": status, "returncode": returncode, "duration_s": round(duration, 3),
                   "restarts": restarts, "result": _metrics.results(_metrics.read_metrics(run_dir))}
        if error is not None:
            outcome.update({"failed_rank": error.rank, "exitcode": error.exitcode, "error": str(error)})
        (run_dir / "result.json").write_text(json.dumps(outcome, indent=2, default=str))
        if kind == "deepspeed":
            _remove_shm_buffers(port)
    if error is not None:
        raise error
    return Run(run_dir=run_dir, returncode=returncode, duration_s=duration, command=cmd, nproc=nproc,
               backend=backend, port=port, restarts=restarts, nnodes=nnodes)


# Errors a rank raises only because a peer died first; never the root cause when another rank has one.
_SECONDARY = re.compile(r"Connection (reset|closed) by peer|remote process exited|DistBackendError|"
                        r"Socket Timeout|Broken pipe|SIGTERM|Signal 15|NCCL communicator was aborted", re.I)


def _remove_shm_buffers(port: int) -> None:
    """DeepSpeed's CPU comm op maps one shared-memory buffer per rank (tens of MB of RAM in /dev/shm, named after the
    master port) and never unlinks it. The course's DeepSpeed scripts unlink their own
    (:func:`helpers.ranks.forget_deepspeed_shm_buffer`); this removes what a run that died earlier, or another
    script, left, once every rank is gone."""
    for path in Path("/dev/shm").glob(f"deepspeed_*_{port}_*"):
        try:
            path.unlink()
        except OSError:
            pass


def _agent_attempts(run_dir: Path) -> dict[Path, list[Path]]:
    """Each torchrun agent's log folder (``elastic/<id>`` or, with nnodes>1, ``elastic/node<i>/<id>``) and its
    ``attempt_<k>`` folders in order."""
    agents: dict[Path, list[Path]] = {}
    for attempt in run_dir.glob("elastic/**/attempt_*"):
        agents.setdefault(attempt.parent, []).append(attempt)
    return {a: sorted(v, key=lambda p: int(p.name.split("_")[1])) for a, v in agents.items()}


def _error_files(run_dir: Path, nproc_per_node: int = 1) -> list[tuple[bool, int, int, dict]]:
    """torchelastic error files of each agent's last attempt (earlier ones were restarted), root causes first:
    primary errors before peer-loss errors, then by write time.

    The files' own timestamps have one-second resolution (a crash and the peer's reaction share it), so the
    file's modification time in nanoseconds orders them."""
    found = []
    for agent, attempts in _agent_attempts(run_dir).items():
        node = int(agent.parent.name[4:]) if agent.parent.name.startswith("node") else 0
        for path in attempts[-1].glob("*/error.json"):
            try:
                data = json.loads(path.read_text())
                msg = data.get("message", {})
                text = msg.get("message", "") if isinstance(msg, dict) else str(msg)
                rank = node * nproc_per_node + int(path.parent.name)  # folders are named by local rank
                found.append((bool(_SECONDARY.search(text)), path.stat().st_mtime_ns, rank, data))
            except (ValueError, OSError):
                continue
    return sorted(found, key=lambda f: (f[0], f[1]))


def _attempts(run_dir: Path) -> int:
    """How many times torchrun started the worker group (1 + restarts), from its per-attempt log folders."""
    return max((len(v) for v in _agent_attempts(run_dir).values()), default=0)


def _failing_rank(session: _Session) -> tuple[int | None, int | None, str | None]:
    """(rank, exitcode, traceback) of the rank that failed first, not of the peers that died with it.

    Evidence, strongest first: a torchelastic error file with a primary error; a rank in torchrun's failure
    summary that exited on its own (not by the agent's SIGTERM/SIGKILL); the first rank whose output
    showed a traceback; then whatever is left."""
    launcher_text = "\n".join(session.launcher_tail)
    # torchrun's failure summary: "rank : 1 (local_rank: 1)" then "exitcode : 1 (pid: ...)"
    exitcodes = {int(r): int(c) for r, c in
                 re.findall(r"rank\s*:\s*(\d+) \(local_rank.*?\n\s*exitcode\s*:\s*(-?\d+)", launcher_text)}
    errors = _error_files(session.run_dir, session.nproc)

    def victim(rank: int) -> bool:
        return bool(_SECONDARY.search("\n".join(session.tails.get(rank, []))))

    def from_file(entry):
        _, _, rank, data = entry
        msg = data.get("message", {})
        tb = msg.get("extraInfo", {}).get("py_callstack") if isinstance(msg, dict) else None
        return rank, exitcodes.get(rank, 1), tb or (msg.get("message") if isinstance(msg, dict) else str(msg))

    if errors and not errors[0][0]:
        return from_file(errors[0])
    self_exited = [r for r, c in exitcodes.items() if c not in (-signal.SIGTERM, -signal.SIGKILL)]
    if self_exited:
        rank = min(self_exited, key=lambda r: (victim(r), session.first_traceback.get(r, float("inf"))))
        return rank, exitcodes[rank], None
    if session.first_traceback:
        rank = min(session.first_traceback, key=lambda r: (victim(r), session.first_traceback[r]))
        return rank, exitcodes.get(rank), None
    if errors:
        return from_file(errors[0])
    root = re.search(r"Root Cause.*?rank\s*:\s*(\d+)", launcher_text, re.S)
    if root:
        rank = int(root.group(1))
        return rank, exitcodes.get(rank), None
    return None, None, None


def _innermost(dump: str, frames: int = 6) -> str:
    """The frames of faulthandler's dump that matter: the current thread's innermost calls."""
    lines = dump.splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith("Current thread")), None)
    if start is None:
        return "\n".join(lines[:frames + 1])
    body = [l for l in lines[start + 1:] if l.startswith("  File")]
    return "\n".join([lines[start]] + body[:frames])


def _tails_text(session: _Session, lines: int = 8, before_stacks: bool = False) -> str:
    parts = []
    for rank, tail in sorted(session.tails.items()):
        if before_stacks:  # the output the rank printed itself, not the stack dump that followed
            cut = next((i for i, t in enumerate(tail) if t.startswith("Fatal Python error: Aborted")), len(tail))
            tail = tail[:cut]
        body = "\n".join("    " + t for t in tail[-lines:]) or "    (no output)"
        parts.append(f"  rank {rank}:\n{body}")
    return "\n".join(parts)


def _error_for(status, session: _Session, script: Path, timeout, stall_timeout) -> LaunchError:
    where = f"run dir: {session.run_dir}"
    if status == "timeout":
        return LaunchError(f"{script.name} exceeded timeout={timeout}s; killed every rank.\n"
                           f"Last output of each rank:\n{_tails_text(session)}\n{where}",
                           run_dir=session.run_dir, reason="timeout")
    if status == "stalled":
        stacks = "".join(f"\n--- Python stack of rank {rank} when it stalled ---\n{_innermost(text)}"
                         for rank, text in sorted(session.stacks.items()))
        return LaunchError(f"{script.name} stalled: no output or metric for {stall_timeout}s (a rank waiting in a "
                           f"collective the others never reach is the usual cause); killed every rank.\n"
                           f"Last output of each rank:\n{_tails_text(session, before_stacks=True)}{stacks}\n{where}",
                           run_dir=session.run_dir, reason="stalled")
    if status in ("interrupted", "error"):
        return LaunchError(f"{script.name} was {status}; killed every rank. {where}", run_dir=session.run_dir,
                           reason=status)
    rank, exitcode, tb = _failing_rank(session)
    if exitcode is None:
        exitcode = session.proc.returncode
    if tb is None and rank is not None:
        tb = "\n".join(session.tails.get(rank, [])[-25:])
    if tb is None:
        tb = "\n".join(session.launcher_tail[-25:])
    who = f"rank {rank}" if rank is not None else "the launcher"
    return LaunchError(f"{who} failed (exit code {exitcode}) running {script.name}.\n"
                       f"--- traceback of {who} ---\n{tb.rstrip()}\n"
                       f"--- last output of every rank ---\n{_tails_text(session)}\n{where}",
                       rank=rank, exitcode=exitcode, run_dir=session.run_dir, reason="failed")


def torchrun(script, nproc=None, args=(), *, env=None, timeout=None, stall_timeout=None, name=None,
             show="rank0", max_restarts: int = 0, nnodes: int = 1) -> Run:
    """Run ``script`` on ``nproc`` ranks with ``torchrun`` and wait for it.

    ``show``: "rank0" streams rank 0's lines, "all" every rank's (and the launcher's), "none" nothing.
    ``timeout``: seconds for the whole run. ``stall_timeout``: seconds without any rank printing or reporting a
    metric, counted from the first such sign of life (start-up is bounded by ``timeout`` only).
    ``max_restarts``: torchrun's elastic restarts (``--max-restarts``) after a rank fails.
    ``env``: extra variables for the ranks; ``{"CUDA_VISIBLE_DEVICES": ""}`` runs CPU ranks with gloo on a GPU machine.
    ``nnodes``: rehearse a multi-node job on this machine: that many torchrun agents ("nodes", see
    :mod:`helpers.nodes`), each running ``nproc`` ranks, meet at a c10d rendezvous. CPU ranks only.

    Example::

        run = torchrun("course/ddp_cifar10.py", nproc=2, args=["--epochs", "1"], stall_timeout=60)
    """
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise LaunchError(f"max_restarts must be a whole number >= 0, got {max_restarts!r}", reason="invalid")

    _check_script_flags(_check_args(args))
    if isinstance(nnodes, bool) or not isinstance(nnodes, int) or nnodes < 1:
        raise LaunchError(f"nnodes must be a whole number >= 1, got {nnodes!r}", reason="invalid")
    if nnodes > 1 and _visible_gpus(_check_env(env)):
        raise LaunchError("nnodes>1 rehearses several nodes on ONE machine, where the 'nodes' would share GPUs; "
                          "pass env={'CUDA_VISIBLE_DEVICES': ''} for CPU ranks, or run one torchrun per real node "
                          "(course/slurm_torchrun.sbatch)", reason="invalid")

    def cmd_for(script_path, nproc_, arg_list, port, run_dir):
        common = ["--nproc-per-node", str(nproc_), "--max-restarts", str(max_restarts), "--monitor-interval", "0.1",
                  "--tee", "3", "--log-line-prefix-template", "[rank${rank}]:", str(script_path), *arg_list]
        if nnodes > 1:
            return [sys.executable, "-m", "helpers.nodes", "--nnodes", str(nnodes), "--port", str(port),
                    "--log-dir", str(run_dir / "elastic"), "--", *common], None
        # c10d rendezvous: each restart re-rendezvouses instead of reading the dead attempt's addresses
        # from a static store (torchelastic's static rendezvous keeps one TCPStore across restarts)
        return [sys.executable, "-m", "torch.distributed.run", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{port}", "--log-dir", str(run_dir / "elastic"), *common], None

    return _launch("torchrun", cmd_for, script, nproc, args, env, timeout, stall_timeout, name, show, nnodes)


def deepspeed(script, nproc=None, args=(), *, config=None, env=None, timeout=None, stall_timeout=None,
              name=None, show="rank0") -> Run:
    """Run ``script`` with DeepSpeed's own launcher (``deepspeed --num_gpus N``).

    ``config`` is a path to a ds_config JSON file or a dict; either way the script receives
    ``--deepspeed_config <file>`` (a dict is written into the run directory first).

    Example::

        run = deepspeed("course/ds_cifar10.py", nproc=2, config={"train_batch_size": 64, ...})
    """
    config_path = None
    if config is not None:
        if isinstance(config, Mapping):
            config_path = dict(config)
        elif isinstance(config, (str, os.PathLike)):
            config_path = Path(config)
            if not config_path.is_absolute() and not config_path.exists():
                config_path = PROJECT_ROOT / config_path
            if not config_path.is_file():
                raise LaunchError(f"DeepSpeed config not found: {config}", reason="invalid")
        else:
            raise LaunchError(f"config must be a dict or a path to a JSON file, got {type(config).__name__}",
                              reason="invalid")

    def precheck(world_size):
        """The config against this world size and device, with messages that say what to change, before
        DeepSpeed's own assertions could be the first thing a learner sees."""
        if config_path is None:
            return
        from . import dsconfig
        try:
            dsconfig.check(config_path, world_size, accelerator="cuda" if default_backend() == "nccl" and
                           _visible_gpus(_check_env(env)) else "cpu")
        except dsconfig.ConfigError as err:
            raise LaunchError(str(err), reason="invalid") from None

    def cmd_for(script_path, nproc_, arg_list, port, run_dir):
        cfg_args = []
        if isinstance(config_path, dict):
            cfg_file = run_dir / "ds_config.json"
            cfg_file.write_text(json.dumps(config_path, indent=2))
            cfg_args = ["--deepspeed_config", str(cfg_file)]
        elif config_path is not None:
            cfg_args = ["--deepspeed_config", str(config_path.resolve())]
        log_dir = run_dir / "ds_logs"
        cmd = [sys.executable, "-c", "from deepspeed.launcher.runner import main; main()",
               "--num_gpus", str(nproc_), "--master_addr", "127.0.0.1", "--master_port", str(port),
               "--enable_each_rank_log", str(log_dir), str(script_path), *arg_list, *cfg_args]
        return cmd, log_dir

    return _launch("deepspeed", cmd_for, script, nproc, args, env, timeout, stall_timeout, name, show,
                   precheck=precheck)
