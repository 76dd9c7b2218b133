"""Measurements for the comparison and tuning chapters (notebooks 04 and 05).

Rank side (called by ``course/ddp_tuning.py`` and ``course/ds_tuning.py``):

* :func:`memory_now` -- this process's memory right now: RSS on any machine, plus CUDA allocated/peak on a GPU.
* :func:`model_state_bytes` -- parameters, gradients and optimizer state a plain (DDP) rank holds, each storage
  counted once; :func:`helpers.memory.measured_model_state_bytes` is the DeepSpeed counterpart.
* :func:`dir_bytes` -- the size of a checkpoint (a file or a folder of shards).

Notebook side:

* :func:`torch_warmup_lr` and :func:`deepspeed_warmup_lr` -- the learning rate each linear-warmup schedule gives
  the optimizer step with index ``k``, to check the rates the runs report against the formula.
* :func:`bytes_sent_per_rank` and :func:`comm_per_step` -- what the counted collectives of a run send per rank.
* :func:`summary` and :func:`table` -- one row per run (memory, speed, communication, loss, checkpoint size) and
  its text table; :data:`COLUMNS` are the table's default columns.

Example::

    from helpers import tuning
    tuning.memory_now(torch.device("cpu"))              # {'rss_mb': 412.3}
    [tuning.deepspeed_warmup_lr(k, 1e-3, 5) for k in range(4)]   # [0.0, 0.0, 0.0002, 0.0004]
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

MB = 2**20


# --------------------------------------------------------------------------------------------- rank side


def memory_now(device) -> dict:
    """``rss_mb``: resident memory of this process (what the OS charges it; on a CPU run, where the model lives).

    On a CUDA device also ``cuda_mb`` (``torch.cuda.memory_allocated``: tensors alive now) and ``cuda_peak_mb``
    (``torch.cuda.max_memory_allocated``: the high-water mark since the start or the last reset).

    Example::

        memory_now(torch.device("cuda", 0))   # {'rss_mb': 2210.4, 'cuda_mb': 801.2, 'cuda_peak_mb': 1630.0}
    """
    import psutil
    import torch

    out = {"rss_mb": round(psutil.Process().memory_info().rss / MB, 1)}
    if getattr(device, "type", str(device)) == "cuda":
        out["cuda_mb"] = round(torch.cuda.memory_allocated(device) / MB, 1)
        out["cuda_peak_mb"] = round(torch.cuda.max_memory_allocated(device) / MB, 1)
    return out


def model_state_bytes(model, optimizer) -> dict:
    """Bytes of ``params``, ``grads`` and ``optimizer`` state (and their ``total``) held by this process.

    Each storage is counted once, whole: DDP's ``gradient_as_bucket_view=True`` makes the gradients views into its
    all-reduce buckets, so the buckets are what is counted. Call it after an optimizer step, before the gradients
    are zeroed, so that gradients and optimizer state both exist.

    Example::

        optimizer.step()
        model_state_bytes(model, optimizer)   # {'params': 2180392, 'grads': 2180392, 'optimizer': 4360788, ...}
    """
    import torch

    seen: set = set()

    def size(tensors) -> int:
        total = 0
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = (t.device.type, t.device.index, storage.data_ptr())
            if storage.nbytes() and key not in seen:
                seen.add(key)
                total += storage.nbytes()
        return total

    params = list(model.parameters())
    out = {"params": size(params), "grads": size(p.grad for p in params),
           "optimizer": size(v for state in optimizer.state.values() for v in state.values())}
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def dir_bytes(path: str | os.PathLike) -> int:
    """Bytes of a file, or of every file under a folder (a sharded DeepSpeed checkpoint)."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# --------------------------------------------------------------------------------------------- schedules


def torch_warmup_lr(k: int, lr: float, warmup_steps: int) -> float:
    """The rate of optimizer step ``k`` (0-based) under ``LambdaLR(opt, lambda s: min(1, s / warmup_steps))``.

    That is ``lr * min(1, k / warmup_steps)``: step 0 runs at 0, full ``lr`` from step ``warmup_steps`` on.

    Example::

        [torch_warmup_lr(k, 1e-3, 4) for k in range(6)]   # [0.0, 0.00025, 0.0005, 0.00075, 0.001, 0.001]
    """
    return lr if warmup_steps <= 0 else lr * min(1.0, k / warmup_steps)


def deepspeed_warmup_lr(k: int, lr: float, warmup_steps: int, min_lr: float = 0.0) -> float:
    """The rate DeepSpeed's ``WarmupLR`` (``warmup_type: "linear"``) gives optimizer step ``k`` (0-based).

    ``WarmupLR`` sets ``min_lr`` when it is built (iteration -1), and ``engine.step()`` advances it after each
    optimizer step to iteration ``i`` with rate ``min_lr + (lr - min_lr) * min(1, i / warmup_steps)``. So step
    ``k`` >= 1 runs at iteration ``k - 1``: one step behind the torch schedule, and with ``min_lr = 0`` the first
    *two* steps change nothing.

    Example::

        [deepspeed_warmup_lr(k, 1e-3, 4) for k in range(6)]   # [0.0, 0.0, 0.00025, 0.0005, 0.00075, 0.001]
    """
    if warmup_steps <= 0:
        return lr
    if k <= 0:
        return min_lr
    return min_lr + (lr - min_lr) * min(1.0, (k - 1) / warmup_steps)


# --------------------------------------------------------------------------------------------- notebook side


def bytes_sent_per_rank(op: str, message_bytes: float, world_size: int) -> float:
    """Bytes one rank sends for one collective under the usual ring algorithms (the ZeRO paper's Sec. 7 model).

    ``message_bytes`` is what the counters record: the tensor handed to the collective. For ``all_reduce`` that is
    the whole buffer S (a ring sends 2 S (N-1)/N: a reduce-scatter then an all-gather); for ``reduce_scatter_tensor``
    the whole input S (S (N-1)/N); for ``all_gather_into_tensor`` this rank's shard s (s (N-1): every other rank
    needs it). Other operations (broadcast, barrier) are counted as their message size.

    Example::

        bytes_sent_per_rank("all_reduce", 4e6, 2)   # 4000000.0
    """
    n = world_size
    if op == "all_reduce":
        return 2 * message_bytes * (n - 1) / n
    if op in ("reduce_scatter_tensor", "reduce_scatter"):
        return message_bytes * (n - 1) / n
    if op in ("all_gather_into_tensor", "all_gather"):
        return message_bytes * (n - 1)
    return float(message_bytes)


def comm_per_step(run) -> dict:
    """``{collective: {"calls", "bytes", "sent_bytes"}}`` per optimizer step of rank 0, plus ``"total_sent_bytes"``.

    Needs a run of ``course/ddp_tuning.py`` (always counted, by a DDP communication hook) or of
    ``course/ds_tuning.py --count-comms`` (DeepSpeed's comms_logger); ``sent_bytes`` is
    :func:`bytes_sent_per_rank` applied to each collective.
    """
    result = run.result
    ops = result.get("comm_per_step") or {}
    n = result.get("world_size", run.nproc)
    out = {op: dict(v, sent_bytes=bytes_sent_per_rank(op, v["bytes"], n)) for op, v in ops.items()}
    out["total_sent_bytes"] = sum(v["sent_bytes"] for v in out.values())
    return out


def summary(run, label: str | None = None) -> dict:
    """One row about a ``course/ddp_tuning.py`` or ``course/ds_tuning.py`` run: what notebooks 04 and 05 compare.

    Keys: ``label``, ``framework``, ``stage``, ``offload``, ``dtype``, ``params``, ``model_states_mb`` (rank 0,
    measured), ``model_states_mb_by_rank``, ``rss_start_mb`` (rank 0 before the model existed: the framework's
    own share), ``peak_rss_mb`` (rank 0's highest per-step RSS), ``peak_cuda_mb`` (GPU runs, rank 0), ``samples_per_s``
    (all ranks, steps after the first), ``first_step_s``, ``final_loss`` (rank 0's last step), ``checkpoint_mb``,
    ``comm_mb_per_step`` (what rank 0 sends per optimizer step, :func:`comm_per_step`), ``peak_rss_mb_by_rank``.

    Example::

        summary(launch.torchrun("course/ddp_tuning.py", nproc=2, args=["--steps", "5"]), "DDP")
    """
    from . import metrics

    result = run.result
    by_rank = run.results_by_rank()
    steps = metrics.steps(run.metrics)
    last = metrics.steps(run.metrics, rank=0)[-1]
    row = {
        "label": label or result.get("framework", "?"),
        "framework": result.get("framework"),
        "stage": result.get("zero_stage"),
        "offload": result.get("offload"),
        "dtype": result.get("dtype"),
        "params": result.get("params"),
        "model_states_mb": result["model_state_bytes"]["total"] / MB,
        "model_states_mb_by_rank": {r: v["model_state_bytes"]["total"] / MB for r, v in by_rank.items()
                                    if "model_state_bytes" in v},
        "rss_start_mb": result.get("rss_start_mb"),
        "peak_rss_mb": max(s["rss_mb"] for s in steps if s["rank"] == 0),
        "peak_rss_mb_by_rank": {r: max(s["rss_mb"] for s in steps if s["rank"] == r)
                                for r in sorted({s["rank"] for s in steps})},
        "samples_per_s": result.get("samples_per_s"),
        "first_step_s": result.get("first_step_s"),
        "final_loss": last["loss"],
        "checkpoint_mb": result["checkpoint_bytes"] / MB if result.get("checkpoint_bytes") is not None else None,
        "comm_mb_per_step": (comm_per_step(run)["total_sent_bytes"] / MB) if result.get("comm_per_step") else None,
    }
    if any("cuda_peak_mb" in s for s in steps):
        row["peak_cuda_mb"] = max(s.get("cuda_peak_mb", 0.0) for s in steps if s["rank"] == 0)
    return row


COLUMNS = (("label", "run", "{}"), ("model_states_mb", "model states MB/rank", "{:.0f}"),
            ("peak_cuda_mb", "peak GPU MB/rank", "{:.0f}"), ("peak_rss_mb", "peak RSS MB/rank", "{:.0f}"),
            ("rss_start_mb", "RSS before model MB", "{:.0f}"), ("samples_per_s", "samples/s", "{:.0f}"),
            ("comm_mb_per_step", "sent MB/step/rank", "{:.0f}"), ("final_loss", "final loss", "{:.4f}"),
            ("checkpoint_mb", "checkpoint MB", "{:.0f}"))


def table(rows: list[Mapping], columns: tuple = COLUMNS) -> str:
    """A plain-text table of :func:`summary` rows (columns absent from every row are left out).

    Example::

        print(table([summary(ddp, "DDP"), summary(z3, "ZeRO-3")]))
    """
    cols = [c for c in columns if any(r.get(c[0]) is not None for r in rows)]
    cells = [[title for _, title, _ in cols]]
    for r in rows:
        cells.append([fmt.format(r[key]) if r.get(key) is not None else "-" for key, _, fmt in cols])
    widths = [max(len(line[i]) for line in cells) for i in range(len(cols))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
             for line in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
