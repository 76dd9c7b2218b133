"""Where a run happens: its directory, the environment its ranks inherit, and a free port for its rendezvous."""
from __future__ import annotations

import itertools
import os
import random
import socket
import time
from pathlib import Path
from typing import Mapping

from ..rank import metrics as _metrics
from .spec import PROJECT_ROOT, _machine, _visible_gpus

_run_counter = itertools.count()


def runs_root() -> Path:
    """Where run directories go: ``$HELPERS_RUNS_DIR`` or ``<project>/runs``."""
    return Path(os.environ.get("HELPERS_RUNS_DIR", PROJECT_ROOT / "runs"))


def _new_run_dir(name: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = runs_root() / name / f"{stamp}-{os.getpid()}-{next(_run_counter)}"
    run_dir.mkdir(parents=True, exist_ok=False)
    return run_dir


def rank_env(nproc: int, run_dir: Path, extra: Mapping[str, str]) -> tuple[dict[str, str], str]:
    """The environment every rank inherits: backend, accelerator, threads, run dir."""
    machine = _machine()
    backend = machine.default_backend() if _visible_gpus(extra) else "gloo"
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
        "OMP_NUM_THREADS": str(max(1, machine.cpu_count() // nproc)),
    })
    if backend != "nccl":
        env["DS_ACCELERATOR"] = "cpu"
    elif env.get("DS_ACCELERATOR") == "cpu" and "DS_ACCELERATOR" not in extra:
        env["DS_ACCELERATOR"] = "cuda"  # the kernel set cpu for DeepSpeed's estimators; ranks with GPUs use them
    env.update(extra)
    return env, backend


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now, so a busy 29500 never matters.

    Between this check and the moment rank 0 (or the torchrun agent) binds the port, seconds pass. A port from the
    kernel's ephemeral range could meanwhile become the source port of any outgoing connection -- gloo opens many --
    and the run would die with EADDRINUSE. So the port comes from just below that range, which the kernel never
    hands out on its own; only where no such range exists does the OS pick one."""
    eph_low, _ = _machine()._ephemeral_port_range()
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
