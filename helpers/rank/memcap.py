"""A memory cap inside each rank: the run that shows what sharding buys on any machine (notebook 07).

The launcher passes ``COURSE_MEMORY_CAP_MIB`` (MiB the rank may allocate above what it holds when the cap is set)
and, for the message, ``COURSE_MEMORY_NEED_MIB`` (what the rank's model states need by the ZeRO formula). The
harness calls :func:`apply_from_env` at the start of training (``harness.datasets``, after the process group and the
framework are up, before the model exists: the point where the scripts read ``rss_start_mib``), so the framework's
own footprint is measured, not guessed, and never counts against the cap. Without the variable nothing happens.

Which limit, and why: ``RLIMIT_DATA``
-------------------------------------
* ``RLIMIT_DATA`` (Linux >= 4.7) counts the private writable mappings of the process (``VmData`` in
  ``/proc/self/status``): the heap, anonymous ``mmap`` and thread stacks -- where every tensor a CPU rank allocates
  lives. Shared mappings (DeepSpeed's 69 MB ``/dev/shm`` comm buffer per rank), code and read-only file mappings,
  and address space merely reserved (glibc reserves 64 MiB per malloc arena as ``PROT_NONE``) do not count. A
  ``malloc``, ``mmap`` or ``mprotect`` past the limit fails with ENOMEM, so the rank sees an ordinary allocation
  error (torch: ``RuntimeError: DefaultCPUAllocator: can't allocate memory``; Python: ``MemoryError``) that it can
  catch and name. It counts what the rank has asked for, touched or not (virtual, not resident): the formula's
  bytes are asked for in full, so the two agree.
* ``RLIMIT_AS`` counts every mapping, reserved or shared: measured here at the cap's point, a rank holds 0.8-1.0 GiB
  of ``VmData`` but 3.6-4.7 GiB of ``VmSize`` (shared libraries, arena reservations and, under DeepSpeed, every
  rank's shared comm buffer, so it grows with the world size): a cap on it says little about the model.
* A cgroup (v2 ``memory.max``, v1 ``memory.limit_in_bytes``) counts resident pages, but needs a writable cgroup
  hierarchy (here the memory controller is only on a v1 hierarchy owned by the container's host; a laptop's
  user session rarely may write one without systemd-run), and past its limit the kernel's OOM killer sends SIGKILL:
  the rank cannot say why it died, and the launcher sees only "exit -9".

So the course uses ``RLIMIT_DATA``: unprivileged, per process, the same on a laptop and in CI's container, and it
fails as an error the rank can report. (macOS does not enforce it: there the cap is announced as not enforced.)

Example (inside a rank, what the harness does)::

    memcap.apply_from_env(rank)   # COURSE_MEMORY_CAP_MIB=250: RLIMIT_DATA = VmData now + 250 MiB
"""
from __future__ import annotations

import os
import resource
import sys

ENV_CAP = "COURSE_MEMORY_CAP_MIB"    # MiB above the rank's footprint when the cap is set
ENV_NEED = "COURSE_MEMORY_NEED_MIB"  # what the formula says this rank's model states need (for the message)
MIB = 2**20
_ALLOCATION_FAILED = ("can't allocate memory", "Cannot allocate memory", "out of memory", "std::bad_alloc")


class RankOutOfMemory(MemoryError):
    """Raised (as the rank's final error) when an allocation failed inside the cap."""


def vm_data_mib(status_path: str = "/proc/self/status") -> float:
    """``VmData`` of this process in MiB: the private writable memory that ``RLIMIT_DATA`` limits."""
    with open(status_path) as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) / 1024
    raise OSError(f"no VmData in {status_path}")


def is_allocation_failure(exc: BaseException) -> bool:
    """True for the errors an allocation past the cap raises: ``MemoryError`` or torch's allocator ``RuntimeError``
    (also when it is the cause or context of the error that reached the top)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, MemoryError) or (isinstance(exc, RuntimeError)
                                             and any(s in str(exc) for s in _ALLOCATION_FAILED)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def message(rank: int, cap_mib: float, baseline_mib: float, need_mib: float | None) -> str:
    """The one line a rank prints when it ran out of memory within the cap.

    Example::

        message(1, 250, 612.4, 320.1)
        # 'rank 1: out of memory within the cap of 250 MiB (above its start-up footprint of 612 MiB; model states
        #  need ~320 MiB by the formula)'
    """
    need = f"; model states need ~{need_mib:.0f} MiB by the formula" if need_mib is not None else ""
    return (f"rank {rank}: out of memory within the cap of {cap_mib:.0f} MiB "
            f"(above its start-up footprint of {baseline_mib:.0f} MiB{need})")


_state: dict = {}
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def _settle_framework() -> None:
    """What would otherwise land on the cap without being training memory, moved before the baseline is read.

    * torch imports ``torch._dynamo`` (and with it sympy) lazily, on the first forward of a DDP or FSDP2 module and
      inside ``deepspeed.initialize``: about 80-150 MiB of Python objects, measured here. That is framework code:
      import it now, so the baseline holds it.
    * glibc returns a freed block to the system only if it was ``mmap``-ed, and raises its mmap threshold (up to
      32 MiB) each time one is freed, so after a few freed tensors a large one lives in the heap and stays counted
      after ``free``. A fixed threshold of 1 MiB (``mallopt``) keeps every tensor of a MiB or more in its own
      mapping: what the cap counts is what is live."""
    import ctypes
    import ctypes.util

    try:
        import torch._dynamo  # noqa: F401
        if "deepspeed" in sys.modules:
            import torch._inductor.lowering  # noqa: F401  (deepspeed.initialize imports it)
    except Exception:  # an older torch: nothing to settle
        pass
    try:
        ctypes.CDLL(ctypes.util.find_library("c")).mallopt(M_MMAP_THRESHOLD, 1 << 20)
    except (OSError, AttributeError):  # not glibc
        pass


def apply_from_env(rank: int | None = None, environ=os.environ) -> dict | None:
    """Set ``RLIMIT_DATA`` to this rank's ``VmData`` now plus ``COURSE_MEMORY_CAP_MIB``, and name an allocation
    failure at the top of the rank (:func:`_name_oom`). Returns ``{"cap_mib", "baseline_mib", "limit_mib",
    "need_mib"}``, or None when the variable is unset. Idempotent: a second call keeps the first cap."""
    raw = environ.get(ENV_CAP)
    if not raw:
        return None
    if _state:
        return dict(_state)
    cap = float(raw)
    if cap <= 0:
        raise ValueError(f"{ENV_CAP} must be a positive number of MiB, got {raw!r}")
    rank = int(environ.get("RANK", 0)) if rank is None else rank
    _settle_framework()
    baseline = vm_data_mib()
    limit = int((baseline + cap) * MIB)
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
    need = environ.get(ENV_NEED)
    _state.update(rank=rank, cap_mib=cap, baseline_mib=baseline, limit_mib=limit / MIB,
                  need_mib=float(need) if need else None)
    enforced = sys.platform.startswith("linux")
    print(f"rank {rank}: memory cap {cap:.0f} MiB above a start-up footprint of {baseline:.0f} MiB "
          f"(RLIMIT_DATA {limit / MIB:.0f} MiB{'' if enforced else ', not enforced on ' + sys.platform})",
          file=sys.stderr, flush=True)
    sys.excepthook = _name_oom(sys.excepthook)
    return dict(_state)


def _name_oom(previous):
    """An excepthook: for an allocation failure, the rank's last words name the cap, and torchelastic's error file
    (which ``@record`` wrote with the bare allocator error) is rewritten with :class:`RankOutOfMemory` chained to
    it, so the launcher's failure message names the cap too."""

    def hook(exc_type, exc, tb):
        if not is_allocation_failure(exc):
            return previous(exc_type, exc, tb)
        resource.setrlimit(resource.RLIMIT_DATA, (resource.getrlimit(resource.RLIMIT_DATA)[1],) * 2)  # room to report
        s = _state
        named = RankOutOfMemory(message(s["rank"], s["cap_mib"], s["baseline_mib"], s["need_mib"]))
        try:
            raise named from exc
        except RankOutOfMemory:
            if os.environ.get("TORCHELASTIC_ERROR_FILE"):
                try:
                    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler
                    path = os.environ["TORCHELASTIC_ERROR_FILE"]
                    if os.path.exists(path):
                        os.remove(path)  # record_exception refuses nothing, but keep only the named error
                    ErrorHandler().record_exception(named)
                except Exception:  # the named line below still says it
                    pass
        previous(exc_type, exc, tb)
        print(f"{type(named).__name__}: {named}", file=sys.stderr, flush=True)

    return hook
