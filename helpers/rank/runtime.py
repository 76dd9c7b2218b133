"""The life of a rank process: who it is, who speaks, and what it leaves behind.

* :func:`launched_ranks` -- RANK, LOCAL_RANK and WORLD_SIZE from the launcher, or a clear "launch me with ..." exit.
* :func:`log0` -- print on rank 0 only: one voice in the terminal, not WORLD_SIZE of them.
* :func:`end_rank` -- the last line of every script in ``course/``: exit after a successful run.
* :func:`forget_deepspeed_shm_buffer` -- right after ``deepspeed.init_distributed()``: leave no RAM in /dev/shm.

Why a course script does not simply return from ``main()``
-----------------------------------------------------------
gloo, the CPU backend, runs each collective on one of its own C++ worker threads. The thread can still hold the
finished collective's tensors for a moment after the main thread has been woken with the result: a barrier keeps
(weak) references to every collective that was in flight when it started, and they are freed when the barrier's
work object is freed, on the worker thread. Freeing a tensor that Python also knew needs the GIL. If, in that
moment, the main thread has already returned and Python is finalizing, CPython ends the worker thread instead of
handing it the GIL; that ends in ``std::terminate`` -- the rank prints ``terminate called without an active
exception``, dies of SIGABRT after all its work is done, and the launcher reports the run as failed.

``dist.destroy_process_group()`` does not prevent it: gloo's ``shutdown()`` is a no-op and its threads are joined
only when the last reference to the group goes, which DeepSpeed keeps until finalization. (A PyTorch PR to
destroy groups at exit, pytorch/pytorch#179291, was abandoned as more complicated than it looked.)

Seen here: in one CI run, and in 2 of about 100 repeated ZeRO-3 runs of notebook 04 on a 2-core machine. The core
dump's aborting thread was ``ProcessGroupGloo::runLoop -> ~AsyncBarrierWork -> ~AsyncAllgatherWork ->
TensorImpl::decref_pyobject -> take_gil -> pthread_exit -> std::terminate``, while the main thread was in
``Py_FinalizeEx``.

So after a successful run the scripts call :func:`end_rank`, which flushes what the rank printed and leaves with
``os._exit``: no finalization, so no thread can be cut off in it. Everything a rank reports is already on disk
(:class:`helpers.rank.metrics.Reporter` writes each record with an unbuffered ``os.write``; checkpoints are fsynced).
A rank that fails raises as usual, so torchrun's error file and traceback are unchanged.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn


def launched_ranks(how: str) -> tuple[int, int, int]:
    """(RANK, LOCAL_RANK, WORLD_SIZE), which torchrun and the deepspeed launcher give every process they start.

    Run with plain ``python``, a script has none of them: it exits with ``how`` (the command to use) instead of
    failing later inside ``init_process_group`` with a message about MASTER_ADDR.

    Example::

        rank, local_rank, world_size = launched_ranks("torchrun --nproc-per-node 2 course/ddp_cifar10.py")
    """
    if "RANK" not in os.environ:
        sys.exit(f"Launch me with a distributed launcher, e.g.: {how}")
    return tuple(int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))


def log0(*args, **kwargs) -> None:
    """``print`` on global rank 0 only, flushed at once (a launcher's pipe would otherwise hold it back)."""
    if os.environ.get("RANK", "0") == "0":
        print(*args, **kwargs, flush=True)


def end_rank(code: int | None = 0) -> NoReturn:
    """Flush stdout, stderr and logging, then exit with ``code`` (``None`` means 0) without interpreter teardown.

    Call it after ``dist.destroy_process_group()``, on the success path only::

        if __name__ == "__main__":
            end_rank(main())
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # closed or replaced streams
            pass
    logging.shutdown()
    os._exit(0 if code is None else int(code))


def forget_deepspeed_shm_buffer(rank: int) -> None:
    """Remove the name of this rank's DeepSpeed shared-memory buffer in /dev/shm; call it on every rank right after
    ``deepspeed.init_distributed()``.

    On CPUs DeepSpeed all-reduces through one shared-memory buffer per rank (69 MB each) and never removes it, so
    every run would leave its buffers in RAM. Once every rank has mapped every buffer (inside init_distributed; the
    barrier makes sure all ranks are past it), the names can go: the mappings stay valid, and the OS frees them when
    the ranks exit, however they exit. ``helpers.launch`` also removes a run's buffers afterwards, for runs that die
    before getting here. Where there is no such buffer (GPUs), only the barrier happens."""
    import torch.distributed as dist  # here, so that end_rank's importers need not load torch

    dist.barrier()
    env = os.environ
    name = f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{env.get('MASTER_ADDR')}_{env.get('MASTER_PORT')}_{rank}"
    if os.path.exists(name):
        os.unlink(name)
