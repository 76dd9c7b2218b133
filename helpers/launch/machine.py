"""The machine a launch runs on, described explicitly: :class:`Machine`, and the CUDA probe it may ask.

Every check and default of the launcher that depends on the hardware reads a :class:`Machine`: how many GPUs the
ranks may use and the backend for them, how many cores, which ports the kernel hands out on its own. The public
``helpers.launch.torchrun`` / ``deepspeed`` take ``machine=`` (None: :meth:`Machine.detect`, this one), so a test
plays a machine with other GPUs, cores or ports by passing one.

The kernel never initialises CUDA. GPUs are counted through NVML (:mod:`helpers.rank.devices`); what needs a CUDA
context -- names, memory, compute capability, cuDNN and NCCL versions -- comes from :func:`cuda_probe`, a short
subprocess (``python -m helpers.launch.machine --probe``) that prints JSON.

Example::

    Machine.detect()                  # Machine(gpus=0, cpus=2, backend='gloo', ephemeral_ports=(32768, 60999), ...)
    Machine(gpus=2, cpus=16)          # a two-GPU machine, NCCL for its ranks
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ..rank import devices

_ROOT = Path(__file__).resolve().parents[2]   # the directory that holds the helpers package
_GIB = 1024 ** 3
_BACKENDS = ("nccl", "gloo")


def ephemeral_port_range() -> tuple[int, int]:
    """The kernel's range for automatically chosen source ports (Linux default 32768-60999)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 49152, 65535  # the IANA dynamic range, which macOS and Windows use


@dataclass(frozen=True)
class Machine:
    """What the launcher needs to know about the machine it starts ranks on.

    ``gpus``: GPUs the ranks may use. ``cpus``: cores this process may run on. ``backend``: the process-group
    backend of ranks that use the GPUs (None: ``"nccl"`` with GPUs, else ``"gloo"``; CPU ranks always use gloo).
    ``ephemeral_ports``: the kernel's range of automatically chosen source ports, which a rendezvous port avoids.
    ``capabilities``: compute capability of each GPU ("8.0", ...), or None to ask :func:`cuda_probe` when a check
    needs them (bf16 needs 8.0+).
    """

    gpus: int
    cpus: int
    backend: str | None = None
    ephemeral_ports: tuple[int, int] = (32768, 60999)
    capabilities: tuple[str | None, ...] | None = None

    def __post_init__(self):
        for label, value, minimum in (("gpus", self.gpus, 0), ("cpus", self.cpus, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"Machine.{label} must be a whole number >= {minimum}, got {value!r}")
        if self.backend is None:
            object.__setattr__(self, "backend", "nccl" if self.gpus else "gloo")
        elif self.backend not in _BACKENDS:
            raise ValueError(f"Machine.backend must be one of {_BACKENDS}, got {self.backend!r}")
        object.__setattr__(self, "ephemeral_ports", tuple(self.ephemeral_ports))
        if self.capabilities is not None:
            object.__setattr__(self, "capabilities", tuple(self.capabilities))

    @classmethod
    def detect(cls) -> Machine:
        """This machine, counted without initialising CUDA (its GPUs' capabilities are asked only when needed)."""
        return cls(gpus=devices.gpu_count(), cpus=devices.cpu_count(), backend=devices.default_backend(),
                   ephemeral_ports=ephemeral_port_range())

    @property
    def default_nproc(self) -> int:
        """One rank per GPU; 2 ranks on CPU (the smallest world where communication happens)."""
        return self.gpus or 2

    def cuda_capabilities(self) -> list[str | None]:
        """Compute capability of each GPU: the ones given, else from :func:`cuda_probe`."""
        return list(self.capabilities) if self.capabilities is not None else cuda_capabilities()


# --- the CUDA probe (runs in a subprocess) ----------------------------------------------------
def _probe_here() -> dict:
    """Runs inside ``python -m helpers.launch.machine --probe``: free to initialise CUDA, then exits."""
    import torch
    out: dict = {"device_count": torch.cuda.device_count(), "devices": [], "cudnn": None, "nccl": None, "error": None}
    if out["device_count"] == 0:
        return out
    try:
        for i in range(out["device_count"]):
            p = torch.cuda.get_device_properties(i)
            out["devices"].append({"index": i, "name": p.name, "memory_total_gib": round(p.total_memory / _GIB, 2),
                                   "capability": f"{p.major}.{p.minor}"})
        out["bf16"] = torch.cuda.is_bf16_supported()
        out["cudnn"] = torch.backends.cudnn.version()
        nccl = torch.cuda.nccl.version()
        out["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    except Exception as exc:  # a broken driver is exactly what the environment report is for
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


@functools.lru_cache(maxsize=1)
def cuda_probe() -> dict:
    """What CUDA says about the visible GPUs (``device_count``, ``devices`` with name, memory and ``capability``,
    ``cudnn``, ``nccl``, ``error``), asked of a subprocess; without GPUs there is nothing to ask, so no subprocess."""
    gpus = devices.gpu_count()
    if gpus == 0:
        return {"device_count": 0, "devices": [], "cudnn": None, "nccl": None, "error": None}
    pythonpath = os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")]))
    try:
        proc = subprocess.run([sys.executable, "-m", "helpers.launch.machine", "--probe"], capture_output=True,
                              text=True, timeout=120, env={**os.environ, "PYTHONPATH": pythonpath})
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except subprocess.TimeoutExpired:
        error = "no answer within 120 s"
    except (json.JSONDecodeError, IndexError):
        error = proc.stderr.strip()[-500:] or f"exit code {proc.returncode}"
    return {"device_count": gpus, "devices": [], "cudnn": None, "nccl": None, "error": f"CUDA probe failed: {error}"}


def cuda_capabilities() -> list[str | None]:
    """Compute capability ("8.0", ...) of each visible GPU, from :func:`cuda_probe`; [] without GPUs, None for a GPU
    the probe could not describe."""
    probe = cuda_probe()
    found = [d.get("capability") for d in probe["devices"]]
    return found or [None] * probe["device_count"]


if __name__ == "__main__":
    if "--probe" in sys.argv[1:]:
        print(json.dumps(_probe_here()))
