"""What course/elastic_cifar10.py needs to crash on purpose and to come back after a restart (notebook 06).

* :func:`maybe_inject_fault` -- ``FAULT_RANK=r FAULT_STEP=s``: rank r exits abruptly after step s, once per job.
* :func:`init_attempt_process_group` -- ``init_process_group`` on the agent's store, under a prefix per restart.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch.distributed as dist


def maybe_inject_fault(rank: int, step: int, snapshot_dir) -> None:
    """Rank FAULT_RANK exits abruptly after step FAULT_STEP, once: the restarted attempt replays the step."""
    marker = Path(snapshot_dir) / "fault_injected"  # "once" has to survive the restart, so it is a file
    if os.environ.get("FAULT_RANK") != str(rank) or os.environ.get("FAULT_STEP") != str(step) or marker.exists():
        return
    marker.write_text(f"rank {rank} (pid {os.getpid()}) exited after step {step}\n")
    print(f"FAULT INJECTED: rank {rank} exits after step {step}", flush=True)
    os._exit(13)  # no exception, no cleanup: like a segfault or the OOM killer


def init_attempt_process_group(backend: str, rank: int, world_size: int, restart_count: int) -> None:
    """``init_process_group`` for attempt ``restart_count`` of an elastic job. torchrun's agent keeps one TCPStore for
    the whole job, and after a restart the addresses the dead processes published are still in it: a new rank can
    read a dead peer's and fail ("Connection refused") or hang (pytorch issues 135712, 167288). So each attempt's keys
    go under their own prefix."""
    store, _, _ = next(dist.rendezvous("env://"))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        store = dist.PrefixStore(f"attempt_{restart_count}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
