"""What one rank holds, measured from inside it: model-state bytes, process memory, checkpoint size.

One counter for every way of training in this course. :func:`model_state_bytes` takes the module and the optimizer
a rank trains with -- a plain or DDP model and its ``torch.optim`` optimizer, or a DeepSpeed engine's ``module``
and ``optimizer`` -- and counts the bytes of parameters, gradients and optimizer state this rank holds, each
storage once, whole (views and flat buffers share storage; DTensor shards count their local part). The formula it
is compared with is :func:`helpers.calc.memory.zero_model_state_bytes`.

Example (inside a rank)::

    optimizer.step()
    model_state_bytes(model, optimizer)                   # {'params': ..., 'grads': ..., 'optimizer': ..., ...}
    model_state_bytes(engine.module, engine.optimizer)    # the same for a DeepSpeed engine, any ZeRO stage
    memory_now(device)                                    # {'rss_mib': 412.3}
"""
from __future__ import annotations

import os
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

MIB = 2**20
KINDS = ("params", "grads", "optimizer")


class _Tally:
    """Bytes per kind, each storage counted once (views and flat buffers share storage)."""

    def __init__(self):
        self.seen: set = set()
        self.bytes: dict[str, int] = defaultdict(int)
        self.sources: dict[str, int] = defaultdict(int)

    def add(self, kind: str, tensor: Any, source: str) -> None:
        import torch
        if not isinstance(tensor, torch.Tensor):
            return
        local = getattr(tensor, "to_local", None)  # a DTensor (FSDP2): this rank holds its local shard only
        if callable(local):
            tensor = local()
        if tensor.device.type == "meta":
            return  # meta tensors are shape bookkeeping, no memory
        storage = tensor.untyped_storage()
        key = (tensor.device.type, tensor.device.index, storage.data_ptr())
        if storage.nbytes() == 0 or key in self.seen:
            return
        self.seen.add(key)
        self.bytes[kind] += storage.nbytes()
        self.sources[f"{kind}: {source}"] += storage.nbytes()


def _walk(obj, path: str, tally: _Tally, visited: set, depth: int = 0) -> None:
    """Every tensor reachable from a DeepSpeed optimizer's attributes: gradients if the path names them, else buffers."""
    import torch
    if depth > 8 or id(obj) in visited:
        return
    visited.add(id(obj))
    if isinstance(obj, torch.Tensor):
        tally.add("grads" if "grad" in path.lower() else "buffers", obj, re.sub(r"\[[^\]]*\]", "[]", path))
    elif isinstance(obj, dict):
        for key, value in obj.items():
            _walk(value, f"{path}[{key if isinstance(key, (str, int)) else ''}]", tally, visited, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            _walk(value, f"{path}[{i}]", tally, visited, depth + 1)
    elif not isinstance(obj, torch.nn.Module) and type(obj).__module__.startswith("deepspeed") \
            and hasattr(obj, "__dict__"):
        for name, value in vars(obj).items():
            _walk(value, f"{path}.{name}", tally, visited, depth + 1)


def model_state_bytes(model, optimizer, *, detail: bool = False) -> dict:
    """Bytes of ``params``, ``grads`` and ``optimizer`` state this rank holds now, and their ``total``.

    ``model``: the module being trained (``ddp.module``, ``engine.module`` or the plain model); ``optimizer``: a
    ``torch.optim`` optimizer, or a DeepSpeed engine's ``engine.optimizer`` (a ZeRO wrapper around one). Call it
    when gradients and optimizer state both exist: after an optimizer step, before the gradients are zeroed (DDP),
    or right after a ``engine.backward`` that follows the first ``engine.step`` (DeepSpeed). Also returns
    ``buffers`` (communication buckets and other tensors a ZeRO optimizer keeps: not model states, not in
    ``total``); ``detail=True`` adds ``sources``, bytes per place they were found.

    What is counted where:

    * params: the module's parameters (DDP: whole; ZeRO 1/2: views of one flat buffer, ``bit16_groups_flat``;
      ZeRO-3: each parameter's ``ds_tensor`` partition plus the small "persistent" parameters every rank keeps
      whole; FSDP2: the local shard of each DTensor parameter);
    * optimizer: the torch optimizer's state (Adam m, v) plus the tensors it updates when they are not the module's
      own -- the fp32 master copies (``single_partition_of_fp32_groups`` at ZeRO 1/2,
      ``fp32_partitioned_groups_flat`` at ZeRO-3);
    * grads: the parameters' ``.grad`` (DDP with ``gradient_as_bucket_view=True``: views into its all-reduce
      buckets, so the buckets are what is counted; ZeRO-1 between the micro batches of one optimizer step) and a
      ZeRO optimizer's partitioned gradients (``averaged_gradients``/``all_grad_tensors`` at ZeRO 1/2,
      ``grad_partitions_flat_buffer`` at ZeRO-3).

    Each storage is counted once, whole (``nbytes`` of the storage, deduplicated by address): views into a flat
    buffer cost nothing extra, and a view keeping a larger tensor alive costs all of it. Systematic differences from
    the ZeRO formula (K = :func:`helpers.calc.memory.deepspeed_k`): alignment padding of the flat partitions and, at
    stage 3, the persistent small parameters (below ``stage3_param_persistence_threshold``); stage 2 keeps the
    whole gradients of the parameters that overlap its partition (up to one layer more than P/N); stage 1 holds the
    full gradient only while gradients accumulate, and with ``gradient_accumulation_steps = 1`` reads like stage 2.

    Example::

        optimizer.step()
        model_state_bytes(model, optimizer)   # {'params': 2180392, 'grads': 2180392, 'optimizer': 4360788, ...}
    """
    import torch
    tally = _Tally()
    for p in model.parameters():
        tally.add("params", p, "module parameters")
        tally.add("params", getattr(p, "ds_tensor", None), "ZeRO-3 parameter partitions (ds_tensor)")
    base = optimizer
    while base is not None and not isinstance(base, torch.optim.Optimizer):
        base = getattr(base, "optimizer", None)  # DeepSpeed's wrappers hold the torch optimizer as .optimizer
    masters = []
    if base is not None:
        # The tensors the torch optimizer updates are the master weights (the module's own under DDP, counted
        # above already); ZeRO-3 swaps them into param_groups only during its step, but they stay the state's keys.
        masters = [p for g in base.param_groups for p in g["params"]] + list(base.state.keys())
        for p in masters:
            tally.add("optimizer", p, "master weights (the tensors the optimizer updates)")
        for state in base.state.values():
            for value in state.values():
                tally.add("optimizer", value, "optimizer state (Adam m, v)")
    for p in model.parameters():
        tally.add("grads", p.grad, "module parameters' .grad")
        tally.add("grads", getattr(p, "grad_accum", None), "module parameters' .grad_accum")
    for p in masters:
        tally.add("grads", p.grad, "master weights' .grad")
    if optimizer is not base and optimizer is not None:
        _walk(optimizer, type(optimizer).__name__, tally, visited={id(base)})
    out = {k: int(tally.bytes.get(k, 0)) for k in KINDS}
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    out["buffers"] = int(tally.bytes.get("buffers", 0))
    if detail:
        out["sources"] = dict(sorted(tally.sources.items(), key=lambda kv: -kv[1]))
    return out


def memory_now(device) -> dict:
    """This process's memory right now, in MiB, as the metrics fields ``rss_mib`` (resident set, sampled now: on a
    CPU run, where the model lives) and, on a CUDA device, ``cuda_mib`` (``torch.cuda.memory_allocated``: tensors
    alive now) and ``cuda_peak_mib`` (``torch.cuda.max_memory_allocated``: the high-water mark since the start).

    Example::

        memory_now(torch.device("cuda", 0))   # {'rss_mib': 2210.4, 'cuda_mib': 801.2, 'cuda_peak_mib': 1630.0}
    """
    import psutil
    import torch

    out = {"rss_mib": round(psutil.Process().memory_info().rss / MIB, 1)}
    if getattr(device, "type", str(device)) == "cuda":
        out["cuda_mib"] = round(torch.cuda.memory_allocated(device) / MIB, 1)
        out["cuda_peak_mib"] = round(torch.cuda.max_memory_allocated(device) / MIB, 1)
    return out


def peak_memory(device) -> dict:
    """This process's high-water marks since it started, in MiB: ``peak_rss_mib`` (the kernel's ``ru_maxrss``) and,
    on a CUDA device, ``cuda_peak_mib``. What a script reports once, at its end."""
    import resource
    import sys

    import torch

    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1024 if sys.platform == "darwin" else 1)
    out = {"peak_rss_mib": round(rss_kib / 1024, 1)}
    if getattr(device, "type", str(device)) == "cuda":
        out["cuda_peak_mib"] = round(torch.cuda.max_memory_allocated(device) / MIB, 1)
    return out


def dir_bytes(path: str | os.PathLike) -> int:
    """Bytes of a file, or of every file under a folder (a sharded DeepSpeed checkpoint)."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
