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
from .machine import Machine, ephemeral_port_range
from .spec import PROJECT_ROOT, _visible_gpus

_run_counter = itertools.count()


def runs_root() -> Path:
    """Where run directories go: ``$HELPERS_RUNS_DIR`` or ``<project>/runs``."""
    return Path(os.environ.get("HELPERS_RUNS_DIR", PROJECT_ROOT / "runs"))


def _new_run_dir(name: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = runs_root() / name / f"{stamp}-{os.getpid()}-{next(_run_counter)}"
    run_dir.mkdir(parents=True, exist_ok=False)
    return run_dir


def rank_env(nproc: int, run_dir: Path, extra: Mapping[str, str], machine: Machine) -> tuple[dict[str, str], str]:
    """The environment every rank inherits, and the backend its ranks use (gloo unless they see GPUs on a machine
    with NCCL).

    Threads (the cores split between the ranks), the run dir, and DeepSpeed's accelerator, set from that backend:
    ``cuda`` for ranks on GPUs, ``cpu`` for gloo ranks, whatever this process has (the notebook kernel sets ``cpu``
    for its own DeepSpeed imports), unless the caller passes ``DS_ACCELERATOR`` in ``extra``."""
    backend = machine.backend if _visible_gpus(extra, machine) else "gloo"
    env = dict(os.environ)
    env.update({
        _metrics.RUN_DIR_ENV: str(run_dir),
        "PYTHONUNBUFFERED": "1",
        # a rank that gets SIGABRT (the launcher sends it to hung ranks) prints every thread's Python stack
        "PYTHONFAULTHANDLER": "1",
        # ranks of a restarted group must not reuse the previous attempt's rendezvous store
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        # ranks share the cores: without this each rank starts one OpenMP thread per core
        "OMP_NUM_THREADS": str(max(1, machine.cpus // nproc)),
        "DS_ACCELERATOR": "cuda" if backend == "nccl" else "cpu",
    })
    env.update(extra)
    return env, backend


def free_port(host: str = "127.0.0.1", machine: Machine | None = None) -> int:
    """A TCP port nobody listens on right now, so a busy 29500 never matters.

    Between this check and the moment rank 0 (or the torchrun agent) binds the port, seconds pass. A port from the
    kernel's ephemeral range could meanwhile become the source port of any outgoing connection -- gloo opens many --
    and the run would die with EADDRINUSE. So the port comes from just below that range, which the kernel never
    hands out on its own (``machine.ephemeral_ports``; None: this machine's); only where no such range exists does
    the OS pick one."""
    eph_low, _ = machine.ephemeral_ports if machine is not None else ephemeral_port_range()
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
