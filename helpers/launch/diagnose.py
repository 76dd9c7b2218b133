"""Why a run failed, from what it left: torchelastic's error files, torchrun's failure summary and the ranks' output.

The rank that failed first is named, not the peers that died with it; a timeout or stall shows every rank's last
output and, for a stall, where each rank's Python stack was.
"""
from __future__ import annotations

import json
import re
import signal
from pathlib import Path
from typing import TYPE_CHECKING

from .session import course_relative
from .spec import LaunchError

if TYPE_CHECKING:
    from .session import _Session

# Errors a rank raises only because a peer died first; never the root cause when another rank has one.
_SECONDARY = re.compile(r"Connection (reset|closed) by peer|remote process exited|DistBackendError|"
                        r"Socket Timeout|Broken pipe|SIGTERM|Signal 15|NCCL communicator was aborted", re.I)



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


def _shown(message: str, **fields) -> LaunchError:
    """The error as a learner reads it: paths under the course root shown relative to it (the logs keep them whole,
    and ``run_dir`` is absolute)."""
    return LaunchError(course_relative(message), **fields)


def _error_for(status, session: _Session, script: Path, timeout, stall_timeout) -> LaunchError:
    where = f"run dir: {session.run_dir}"
    if status == "timeout":
        return _shown(f"{script.name} exceeded timeout={timeout}s; killed every rank.\n"
                           f"Last output of each rank:\n{_tails_text(session)}\n{where}",
                           run_dir=session.run_dir, reason="timeout")
    if status == "stalled":
        stacks = "".join(f"\n--- Python stack of rank {rank} when it stalled ---\n{_innermost(text)}"
                         for rank, text in sorted(session.stacks.items()))
        return _shown(f"{script.name} stalled: no output or metric for {stall_timeout}s (a rank waiting in a "
                           f"collective the others never reach is the usual cause); killed every rank.\n"
                           f"Last output of each rank:\n{_tails_text(session, before_stacks=True)}{stacks}\n{where}",
                           run_dir=session.run_dir, reason="stalled")
    if status in ("interrupted", "error"):
        return _shown(f"{script.name} was {status}; killed every rank. {where}", run_dir=session.run_dir,
                           reason=status)
    rank, exitcode, tb = _failing_rank(session)
    if exitcode is None:
        exitcode = session.proc.returncode
    if tb is None and rank is not None:
        tb = "\n".join(session.tails.get(rank, [])[-25:])
    if tb is None:
        tb = "\n".join(session.launcher_tail[-25:])
    who = f"rank {rank}" if rank is not None else "the launcher"
    return _shown(f"{who} failed (exit code {exitcode}) running {script.name}.\n"
                       f"--- traceback of {who} ---\n{tb.rstrip()}\n"
                       f"--- last output of every rank ---\n{_tails_text(session)}\n{where}",
                       rank=rank, exitcode=exitcode, run_dir=session.run_dir, reason="failed")
