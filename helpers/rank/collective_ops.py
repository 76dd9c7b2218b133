"""The collectives course/collective_sweep.py times, each built once for a message size, and the profiler
around its sweep.

:func:`collective` returns a function that runs one call of an op on buffers made once, sized by the course's
byte counters (:mod:`helpers.calc.comm`): the whole tensor for all_reduce, reduce_scatter and broadcast, this
rank's shard for all_gather, the message for send_recv (to the next rank and from the one before) and for send
(rank 0 to rank 1 only). :func:`tracing` wraps the sweep in torch.profiler and writes a trace per rank to the run
directory, as the harness's --profile-steps does for a training run.

Example (inside a rank, after init_process_group)::

    run = collective("all_reduce", 1 << 20, rank, world, device)
    with tracing(True, rank, device):
        run()
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from .metrics import RUN_DIR_ENV

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv", "send")


def collective(op: str, size_bytes: int, rank: int, world: int, device):
    """A function that runs one ``op`` of ``size_bytes`` (the course's message size), its buffers made once."""
    n = max(world, size_bytes // 4 // world * world)  # float32 elements, a multiple of the ranks
    whole = torch.ones(n, device=device)
    shard = torch.ones(n // world, device=device)
    if op == "all_reduce":
        return lambda: dist.all_reduce(whole)
    if op == "all_gather":  # this rank's shard of size_bytes in, the whole (world x shard) out
        shard, whole = torch.ones(n, device=device), torch.ones(n * world, device=device)
        return lambda: dist.all_gather_single(whole, shard)
    if op == "reduce_scatter":  # the whole in, this rank's shard of the sum out
        return lambda: dist.reduce_scatter_single(shard, whole)
    if op == "broadcast":
        return lambda: dist.broadcast(whole, src=0)
    if op == "send_recv":  # to the next rank, from the one before: a pipeline boundary in both directions
        incoming = torch.empty_like(whole)

        def send_recv():
            for req in dist.batch_isend_irecv([dist.P2POp(dist.isend, whole, (rank + 1) % world),
                                               dist.P2POp(dist.irecv, incoming, (rank - 1) % world)]):
                req.wait()
        return send_recv
    if op == "send":  # one way, rank 0 to rank 1, as a two-stage pipeline sends its activations; others idle
        def send():
            if rank == 0:
                dist.send(whole, dst=1)
            elif rank == 1:
                dist.recv(whole, src=0)
        return send
    raise ValueError(f"unknown collective {op!r}: one of {', '.join(OPS)}")


@contextlib.contextmanager
def tracing(on: bool, rank: int, device):
    """torch.profiler around the sweep (when ``on``), its trace written as trace_rank<R>.json to the run
    directory, as the harness's --profile-steps writes a training run's."""
    if not on:
        yield
        return
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        yield
    prof.export_chrome_trace(str(Path(os.environ.get(RUN_DIR_ENV) or ".") / f"trace_rank{rank}.json"))
