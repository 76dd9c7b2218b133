"""Checkers for notebook 00's exercises: bus bandwidth from a timed all-reduce, and the launch a machine calls for.

Both return a :class:`~helpers.notebook.exercises.Verdict` and never raise; hints name the missing idea and never
print the expected answer.

Example::

    from helpers.notebook.exercises import env as ex
    ex.check_busbw(1.75, size_bytes=1e9, seconds=1.0, world_size=8)
    # Correct: algbw = 1.000 GB/s, busbw = algbw x 2(n-1)/n = 1.750 GB/s.
"""
from __future__ import annotations

import numbers

from helpers.calc import comm
from helpers.notebook.exercises import Verdict, _never_raises, _real_number
from helpers.notebook.i18n import _

_TOLERANCE = 0.01  # relative: a GB/s figure rounded to 2-3 digits is right


def _real(answer) -> float | None:
    """``answer`` as a finite float (see :func:`helpers.notebook.exercises._real_number`), else None."""
    value = _real_number(answer)
    return None if value is None else float(value)


def _close(value: float, target: float) -> bool:
    return abs(value - target) <= _TOLERANCE * abs(target)


@_never_raises
def check_busbw(answer, *, size_bytes: float, seconds: float, world_size: int) -> Verdict:
    """Bus bandwidth in GB/s (1e9 bytes/s) of one all-reduce of ``size_bytes`` that took ``seconds`` on
    ``world_size`` ranks (nccl-tests' definitions, ``helpers.calc.comm.bus_bandwidth``).

    Example::

        >>> check_busbw(1.75, size_bytes=1e9, seconds=1.0, world_size=8)
        Correct: algbw = 1.000 GB/s, busbw = algbw x 2(n-1)/n = 1.750 GB/s.
        >>> check_busbw(1.0, size_bytes=1e9, seconds=1.0, world_size=8)
        Not yet: 1 GB/s is not the bus bandwidth.
        Hint: That is algbw, size / time: what your program sees. ...
    """
    value = _real(answer)
    if value is None:
        return Verdict(False, _("expected a number of GB/s, got {answer!r} ({answer_type}).",
                                answer=answer, answer_type=type(answer).__name__),
                       _("Answer with a number such as 3.2 (GB/s), not a string or a list."))
    algbw, right = comm.bus_bandwidth(size_bytes, seconds, world_size)
    if _close(value, right):
        return Verdict(True, _("algbw = {algbw:.3f} GB/s, busbw = algbw x 2(n-1)/n = {right:.3f} GB/s.",
                               algbw=algbw, right=right))
    wrong = _("{value:g} GB/s is not the bus bandwidth.", value=value)
    n = world_size
    if _close(value, algbw):
        return Verdict(False, wrong, _("That is algbw, size / time: what your program sees. busbw corrects it for "
                                       "how often a ring all-reduce sends each byte over the slowest link."))
    gib = 2**30 / 1e9  # the same rate expressed in GiB/s is smaller by this factor
    if _close(value, right / gib) or _close(value, algbw / gib):
        return Verdict(False, wrong, _("Check the unit: nccl-tests' GB/s are 1e9 bytes per second, not 2**30. "
                                       "Convert the message size to bytes first."))
    if _close(value, right * 1e3) or _close(value, right / 1e3) or _close(value, right * 1e6):
        return Verdict(False, wrong, _("Off by a power of 1000: check the time (seconds, not ms or us) and "
                                       "the size (bytes), then divide by 1e9 for GB/s."))
    if n > 1 and _close(value, algbw * 2):
        return Verdict(False, wrong, _("The factor is not 2: each rank sends 2(n-1) chunks of size / n, "
                                       "so it depends on the number of ranks."))
    if n > 1 and _close(value, algbw * (n - 1) / n):
        return Verdict(False, wrong, _("Half of it: a ring all-reduce is a reduce-scatter AND an all-gather, "
                                       "each moving (n-1)/n of the data."))
    if n > 1 and _close(value, algbw * n / (2 * (n - 1))):
        return Verdict(False, wrong, _("Upside down: busbw is at least algbw for n >= 2, because the ring sends "
                                       "more bytes over each link than the message holds."))
    if n > 1 and _close(value, algbw * 2 * (n - 1)):
        return Verdict(False, wrong, _("Each of the 2(n-1) ring steps moves only 1/n of the message: "
                                       "divide by n."))
    return Verdict(False, wrong, _("Two steps: algbw = size in bytes / seconds / 1e9, then multiply by the "
                                   "all-reduce correction factor for n ranks."))


def _visible_gpus(gpus_installed: int, visible_devices: str | None) -> int:
    """How many GPUs a process sees: all of them unless CUDA_VISIBLE_DEVICES names a subset ("" hides all)."""
    if visible_devices is None:
        return gpus_installed
    return len([d for d in visible_devices.split(",") if d.strip()])


@_never_raises
def check_launch(answer, *, gpus_installed: int, visible_devices: str | None, cores: int) -> Verdict:
    """The ``(backend, nproc)`` to launch one DDP job with on a machine: NCCL and one rank per *visible* GPU;
    without a visible GPU, gloo and 1 to ``cores`` ranks.

    Example::

        >>> check_launch(("nccl", 4), gpus_installed=8, visible_devices="0,1,2,3", cores=64)
        Correct: backend nccl, 4 ranks: one per GPU this process can see.
    """
    if not (isinstance(answer, (tuple, list)) and len(answer) == 2):
        return Verdict(False, _("expected a pair (backend, nproc), got {answer!r}.", answer=answer),
                       _('Answer with a tuple such as ("gloo", 2): the backend as a string, then the rank count.'))
    backend, nproc = answer
    if not isinstance(backend, str) or isinstance(nproc, bool) or not isinstance(nproc, numbers.Integral):
        return Verdict(False, _("expected (backend as a string, nproc as a whole number), got {answer!r}.",
                                answer=answer),
                       _('For example ("gloo", 2).'))
    backend, nproc = backend.strip().lower(), int(nproc)
    visible = _visible_gpus(gpus_installed, visible_devices)
    if backend not in ("nccl", "gloo", "mpi"):
        return Verdict(False, _("{backend!r} is not a torch.distributed backend.", backend=backend),
                       _("Section 3 lists the backends this PyTorch build knows."))
    if backend == "mpi":
        return Verdict(False, _("mpi exists only in PyTorch builds made with MPI (section 3 shows this one's), "
                                "and DDP on GPUs is NCCL's job."),
                       _("Pick the backend that fits the devices the ranks use."))
    if visible:
        if backend == "gloo":
            return Verdict(False, _("gloo would run, but not well."),
                           _("gloo can carry CUDA tensors, slowly, through the host. Which backend talks GPU to GPU?"))
        if nproc == visible:
            return Verdict(True, _("backend nccl, {visible} ranks: one per GPU this process can see.", visible=visible))
        if nproc == gpus_installed and visible != gpus_installed:
            return Verdict(False, _("{nproc} ranks: more than this process can use.", nproc=nproc),
                           _("nvidia-smi counts the installed GPUs; CUDA_VISIBLE_DEVICES decides which ones a process "
                             "sees. Count the devices it names."))
        if nproc == cores:
            return Verdict(False, _("{nproc} ranks: one per core.", nproc=nproc),
                           _("With GPUs, a rank drives one GPU; the cores only feed it. How many GPUs can the ranks "
                             "use?"))
        if nproc > visible:
            return Verdict(False, _("{nproc} ranks: more ranks than visible GPUs.", nproc=nproc),
                           _("NCCL needs a GPU of its own for each rank (the course refuses more ranks than GPUs)."))
        return Verdict(False, _("{nproc} ranks leave GPUs idle.", nproc=nproc),
                       _("DDP runs one rank per GPU: use every GPU the process can see."))
    if backend == "nccl":
        return Verdict(False, _("nccl needs a GPU, and this process sees none."),
                       _("Count the GPUs the process can see, not the ones installed: an empty CUDA_VISIBLE_DEVICES "
                         "hides them all.") if gpus_installed else _("Which backend runs on CPUs?"))
    if 1 <= nproc <= cores:
        return Verdict(True, _("backend gloo, {nproc} rank(s) on {cores} cores: the ranks share the CPU.",
                               nproc=nproc, cores=cores))
    if nproc < 1:
        return Verdict(False, _("{nproc} ranks cannot run anything.", nproc=nproc),
                       _("A job needs at least one rank."))
    return Verdict(False, _("{nproc} ranks on {cores} cores overcommit the CPU.", nproc=nproc, cores=cores),
                   _("Each CPU rank needs at least one core of its own, or the ranks slow each other down."))
