"""A warm start for the launcher process: forked from a server that has already imported torch.

Every launch begins with one process, torchrun's agent (or DeepSpeed's per-node launcher), and its first two seconds
are ``import torch`` while no rank exists yet. The ranks then import torch themselves, as they must. This module
starts, on a process's first launch, one server that imports ``torch.distributed.run`` and nothing else runs; each
launch that finds it ready (until then, launches start fresh interpreters: none waits for it) asks it over a Unix
socket for a *fork* of itself that runs the same ``python -c CODE ...`` command line the launch would have
started: torch's own ``torch.distributed.run.main()`` (or DeepSpeed's launcher), with the launch's arguments,
environment and working directory, its output into the launch's pipe, in a session of its own.
Only the interpreter's start-up and the import are skipped; everything from the agent on is the same code.
benchmarks/bench_launcher.py times it against bare ``torchrun`` (with ``HELPERS_WARM_LAUNCH=0``: the cold start).

:func:`start` returns a :class:`WarmProcess`, which answers what :class:`subprocess.Popen` answers for the session
(``pid``, ``stdout``, ``poll``, ``wait``, ``returncode``), or None when the command is not one it can fork (then the
caller starts a process as before). The server dies with the process that started it, and kills every launcher it
forked, with their ranks, when it does; a forked launcher watches the server the same way.

``HELPERS_WARM_LAUNCH=0`` turns it off: every launcher is then a fresh interpreter.
"""
from __future__ import annotations

import json
import os
import select
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ENV_SWITCH = "HELPERS_WARM_LAUNCH"
# read when the interpreter starts or torch's launcher is imported, so a launch whose value differs from the server's
# gets a fresh interpreter (PYTHONUNBUFFERED and PYTHONFAULTHANDLER, which every launch sets, are applied in the fork)
IMPORT_TIME_ENV = ("LOGLEVEL", "TORCH_LOGS", "TORCH_CPP_LOG_LEVEL", "PYTHONPATH", "PYTHONHASHSEED", "PYTHONWARNINGS",
                   "PYTHONDONTWRITEBYTECODE", "PYTHONOPTIMIZE", "PYTHONSAFEPATH", "PYTHONNOUSERSITE")
PRELOAD = "torch.distributed.run"
START_S = 60.0  # the server's import of torch, on a busy machine

_server = None
_server_lock = threading.Lock()


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0" and os.name == "posix" and hasattr(socket, "send_fds")


class _Server:
    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="helpers-warm-")
        self.path = os.path.join(self.dir, "s")
        self.env = dict(os.environ)
        self.proc = subprocess.Popen([sys.executable, "-m", "helpers.launch.warm", self.path, str(os.getpid())],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True, env=self.env, cwd=str(Path(__file__).parents[2]))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def ready(self, wait: float = 0.0) -> bool:
        """Whether the server has imported torch and listens, waiting up to ``wait`` seconds for it."""
        deadline = time.monotonic() + wait
        while self.alive():
            if os.path.exists(self.path + ".ready"):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return False

    def connect(self) -> socket.socket | None:
        """A connection, only if the server is ready now: a launch never waits for the server's import of torch (a
        press of the stop button would wait with it), it starts a fresh interpreter instead."""
        if not self.ready():
            return None
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(self.path)
            return s
        except OSError:
            s.close()
            return None


def _get_server() -> _Server | None:
    global _server
    with _server_lock:
        if _server is None or not _server.alive():
            try:
                _server = _Server()
            except OSError:
                _server = None
        return _server


def is_server(p) -> bool:
    """Whether the psutil process ``p`` is a warm server (its forks carry the same command line, under a server)."""
    import psutil

    def warm_cmdline(q) -> bool:
        try:
            return q.cmdline()[1:3] == ["-m", "helpers.launch.warm"]
        except (psutil.Error, OSError):
            return False

    try:
        return warm_cmdline(p) and not warm_cmdline(p.parent())
    except psutil.Error:
        return False


def warm_up(wait: bool = False) -> bool:
    """Start the server now (it imports torch in the background), so that a later launch finds it ready; with
    ``wait``, return once it is (up to START_S seconds). Whether it is ready."""
    server = _get_server() if enabled() else None
    return server is not None and server.ready(START_S if wait else 0.0)


def start(cmd: list[str], env: dict, cwd: str) -> WarmProcess | None:
    """Fork ``cmd`` (``[sys.executable, "-c", CODE, *args]``, ``-u`` allowed before ``-c``) from the warm server
    with ``env`` and ``cwd``; None when warm starts are off, the command is another kind, the environment differs
    from the server's where an import reads it, or the server is not ready or cannot be reached (the caller then
    starts a fresh process)."""
    unbuffered = len(cmd) > 1 and cmd[1] == "-u"  # DeepSpeed's launcher: `python -u -c ...`
    if unbuffered:
        cmd = [cmd[0], *cmd[2:]]
    if not enabled() or len(cmd) < 3 or cmd[0] != sys.executable or cmd[1] != "-c":
        return None
    server = _get_server()
    if server is None or any(env.get(k) != server.env.get(k) for k in IMPORT_TIME_ENV):
        return None
    conn = server.connect()
    if conn is None:
        return None
    read_end, write_end = os.pipe()
    try:
        payload = json.dumps({"argv": cmd[1:], "env": env, "cwd": cwd, "unbuffered": unbuffered}).encode()
        socket.send_fds(conn, [struct.pack("!I", len(payload))], [write_end])
        conn.sendall(payload)
        os.close(write_end)
        write_end = -1
        proc = WarmProcess(conn, os.fdopen(read_end, "rb"))
        if proc.pid is None:
            raise OSError("the warm server did not fork")
        return proc
    except OSError:
        conn.close()
        if write_end >= 0:
            os.close(write_end)
        return None


class WarmProcess:
    """A forked launcher, seen as :class:`subprocess.Popen` sees its child: the server that forked and reaps it reports
    its pid, then its exit code (negative: the signal that ended it) on the connection."""

    def __init__(self, conn: socket.socket, stdout):
        self.conn, self.stdout, self.returncode, self._buf = conn, stdout, None, b""
        self._lock = threading.Lock()
        line = self._line(START_S)
        self.pid = int(line[2:]) if line and line.startswith("P ") else None

    def _line(self, timeout: float | None) -> str | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self.conn], [], [], left)
            if not ready:
                return None
            chunk = self.conn.recv(4096)
            if not chunk:  # the server died: the launcher was killed with it
                return "X -9"
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    def _exit(self, timeout: float | None) -> int | None:
        with self._lock:
            if self.returncode is None:
                line = self._line(timeout)
                if line is not None and line.startswith("X "):
                    self.returncode = int(line[2:])
                    self.conn.close()
            return self.returncode

    def poll(self) -> int | None:
        return self._exit(0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._exit(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(["<warm launcher>"], timeout)
        return code

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(9)


# ------------------------------------------------------------------------------------------------ the server side

def _child(request: dict, out_fd: int, server_pid: int) -> None:
    """In the forked launcher: become what ``python -c CODE *args`` would have started. The server is a fresh
    interpreter that changed no signal handler and printed nothing, so only the descriptors, the session, the
    working directory, the environment and ``__main__`` are set here."""
    import traceback
    import types

    code = 1
    try:
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        os.close(null)
        os.close(out_fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        if os.environ.get("PYTHONUNBUFFERED") or request.get("unbuffered"):  # as `python -u`
            sys.stdout.reconfigure(write_through=True, line_buffering=False)
            sys.stderr.reconfigure(write_through=True)
        if os.environ.get("PYTHONFAULTHANDLER"):
            import faulthandler
            faulthandler.enable()
        from .processes import WATCH_PARENT  # the watch a fresh launcher runs, on the server instead of the kernel

        watch: dict = {}
        exec(compile(WATCH_PARENT, "<watch>", "exec"), watch)
        threading.Thread(target=watch["watch"], args=(server_pid,), daemon=True, name="parent-watch").start()
        _, target, *rest = request["argv"]
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        sys.argv = ["-c", *rest]
        try:
            exec(compile(target, "<string>", "exec"), main.__dict__)
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
        except BaseException as e:  # what the interpreter prints for an uncaught exception, from the command on
            traceback.print_exception(type(e), e, e.__traceback__.tb_next)
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _recv_request(conn: socket.socket) -> tuple[dict, int]:
    msg, fds, _, _ = socket.recv_fds(conn, 4, 1)
    while len(msg) < 4:
        more = conn.recv(4 - len(msg))
        if not more:
            raise OSError("short request")
        msg += more
    (size,) = struct.unpack("!I", msg[:4])
    data = b""
    while len(data) < size:
        more = conn.recv(size - len(data))
        if not more:
            raise OSError("short request")
        data += more
    if len(fds) != 1:
        raise OSError("no output pipe")
    return json.loads(data), fds[0]


def _kill_all(children: dict) -> None:
    import psutil

    for pid in list(children):
        try:
            procs = psutil.Process(pid).children(recursive=True) + [psutil.Process(pid)]
        except psutil.Error:
            continue
        for p in procs:
            try:
                p.kill()
            except psutil.Error:
                pass


def serve(path: str, parent: int) -> None:
    """The server: import torch's launcher once, then fork one launcher per request, reap them and report their exit
    codes; when ``parent`` (the process that launches) dies, kill every launcher with its ranks and leave."""
    import importlib

    importlib.import_module(PRELOAD)
    import psutil  # noqa: F401  (the launchers' own watch uses it)

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    Path(path + ".ready").touch()
    children: dict[int, socket.socket] = {}
    try:
        while os.getppid() == parent:
            ready, _, _ = select.select([listener], [], [], 0.05)
            if ready:
                conn, _ = listener.accept()
                try:
                    request, out_fd = _recv_request(conn)
                except (OSError, ValueError):
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    for c in children.values():
                        c.close()
                    conn.close()
                    _child(request, out_fd, os.getppid())
                os.close(out_fd)
                children[pid] = conn
                _send(conn, f"P {pid}\n")
            for pid in list(children):
                try:
                    done, status = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    done, status = pid, 0
                if done:
                    _send(children.pop(pid), f"X {os.waitstatus_to_exitcode(status)}\n", close=True)
    finally:
        _kill_all(children)
        for pid in list(children):
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        try:
            os.unlink(path)
            os.unlink(path + ".ready")
            os.rmdir(os.path.dirname(path))
        except OSError:
            pass


def _send(conn: socket.socket, text: str, close: bool = False) -> None:
    try:
        conn.sendall(text.encode())
    except OSError:
        pass
    if close:
        conn.close()


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
