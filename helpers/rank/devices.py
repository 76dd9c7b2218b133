"""Which devices and backend a rank uses, counted without initialising CUDA.

Both sides read these: a rank picks its device and backend from them (:func:`rank_device`), and the notebook
kernel's launcher uses the same counts for its defaults (one rank per GPU, threads split between CPU ranks).
Counting GPUs asks NVML through ``torch.cuda.device_count()`` and leaves CUDA uninitialised, so the kernel may
call everything here except :func:`rank_device`, which binds this process to a GPU.

Example (inside a rank)::

    device, backend = rank_device()      # (device(type='cpu'), 'gloo') on a CPU-only machine
    dist.init_process_group(backend)
"""
from __future__ import annotations

import os
from pathlib import Path


def gpu_count() -> int:
    """CUDA devices this process may use (honours CUDA_VISIBLE_DEVICES); 0 without a CUDA build."""
    import torch
    return torch.cuda.device_count()


def default_backend() -> str:
    """``"nccl"`` when GPUs are visible and the build has NCCL, else ``"gloo"``."""
    import torch.distributed as dist
    return "nccl" if gpu_count() > 0 and dist.is_nccl_available() else "gloo"


def default_nproc() -> int:
    """One rank per GPU; 2 ranks on CPU (the smallest world where communication happens)."""
    return gpu_count() or 2


def cpu_count() -> int:
    """CPU cores this process may run on: the affinity mask, capped by a cgroup v2 quota if set."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    try:  # docker --cpus=N sets a quota but leaves the affinity mask at every core
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            n = min(n, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return n


def rank_device(local_rank: int | None = None):
    """(device, backend) for this rank: GPU number LOCAL_RANK with NCCL when GPUs are visible, else CPU with gloo.

    With GPUs it also calls ``torch.cuda.set_device`` -- before ``init_process_group``, so NCCL binds each rank to
    its own GPU. Only for rank processes: it initialises CUDA.
    """
    import torch
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), "nccl"
    return torch.device("cpu"), "gloo"
