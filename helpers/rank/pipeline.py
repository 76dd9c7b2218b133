"""The pipeline's stopwatch: times every action a torch.distributed.pipelining schedule runs on this rank's stages
and weighs the activations each stage holds, for course/gpt_pp.py.

:meth:`StageClock.watch` wraps three methods of a ``PipelineStage`` instance, the ones every schedule calls for
its compute actions (their names are pinned by tests/test_pp.py)::

    forward_one_chunk(i, ...)            -> "F" (forward of micro-batch i; the loss, on the last stage, follows it)
    backward_one_chunk(i, full_backward) -> "B" (full backward) or "I" (input gradient only, zero-bubble schedules)
    backward_weight_one_chunk(i)         -> "W" (the weight gradient the zero-bubble schedules run later)

An action is ``[step, kind, stage, micro-batch, t0, t1]``, seconds since :meth:`StageClock.start` (called on every
rank right after a barrier, so the ranks' zeros agree to a message latency). Activations: during each forward, a
``saved_tensors_hooks`` pair adds up the bytes of the tensors autograd saves for backward (parameters left out,
each storage counted once; a tensor-parallel ``DTensor`` counts its local shard, what this rank holds); a
micro-batch's bytes count as held from its forward's end until its backward ("B" or "I") ends.
:meth:`StageClock.peak_bytes` is the most a stage held at once.
"""
from __future__ import annotations

import time

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn import functional as F


def local_storage(t: torch.Tensor):
    """The storage this rank holds for ``t``: a DTensor's local shard, a plain tensor's own."""
    if isinstance(t, DTensor):
        with torch.no_grad():
            t = t.to_local()
    return t.untyped_storage()


def saved_bytes_by_module(fn, modules: dict) -> tuple:
    """``fn()`` and, per named module of ``modules``, the bytes autograd saved for backward while that module's
    forward ran (each storage once, a DTensor's local shard, the modules' parameters left out): what each layer
    keeps on this rank."""
    exclude = {local_storage(p).data_ptr() for m in modules.values() for p in m.parameters()}
    seen: dict[str, dict[int, int]] = {name: {} for name in modules}
    current: list[str] = []

    def pack(t):
        storage = local_storage(t)
        if current and storage.data_ptr() not in exclude:
            seen[current[-1]][storage.data_ptr()] = storage.nbytes()
        return t

    def enter(name):
        return lambda *_: current.append(name)  # returns None: the module's input stays as it is

    def leave(*_):
        current.pop()  # returns None: the module's output stays as it is

    hooks = [m.register_forward_pre_hook(enter(name)) for name, m in modules.items()]
    hooks += [m.register_forward_hook(leave) for m in modules.values()]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn()
    finally:
        for h in hooks:
            h.remove()
    return out, {name: sum(b.values()) for name, b in seen.items()}


def state_bytes(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Bytes this rank holds of parameters, gradients and optimizer state (local shards of DTensors; elements x
    element size, since a shard can be a view of a larger storage)."""
    def size(t):
        if not isinstance(t, torch.Tensor):
            return 0
        local = t.to_local() if isinstance(t, DTensor) else t
        return local.numel() * local.element_size()

    params = list(module.parameters())
    return {"params": sum(size(p) for p in params), "grads": sum(size(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(size(v) for state in optimizer.state.values() for v in state.values())}


class StageClock:
    def __init__(self):
        self.actions: list[list] = []
        self.step, self._zero = 0, time.perf_counter()
        self._bytes: dict[tuple[int, int], int] = {}  # (stage, micro-batch) -> bytes saved by its forward
        self._held: dict[int, int] = {}
        self._peak: dict[int, int] = {}

    def start(self, step: int) -> None:
        self.step, self._zero = step, time.perf_counter()

    def record(self, kind: str, stage: int, microbatch: int, t0: float) -> None:
        self.actions.append([self.step, kind, stage, microbatch, t0 - self._zero, time.perf_counter() - self._zero])

    def peak_bytes(self) -> dict:
        return {str(s): b for s, b in sorted(self._peak.items())}

    @staticmethod
    def _saved_bytes(fn, *args, exclude=frozenset(), **kwargs):
        """``fn(*args, **kwargs)`` and the bytes autograd saved for backward during it (each storage once, those in
        ``exclude`` left out)."""
        seen: dict[int, int] = {}

        def pack(t):
            storage = local_storage(t)
            if storage.data_ptr() not in exclude:
                seen[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn(*args, **kwargs)
        return out, sum(seen.values())

    def _hold(self, stage: int, chunk: int, nbytes: int) -> None:
        """Count ``nbytes`` more as held by ``stage`` for micro-batch ``chunk`` until its backward."""
        self._bytes[(stage, chunk)] = self._bytes.get((stage, chunk), 0) + nbytes
        self._held[stage] = self._held.get(stage, 0) + nbytes
        self._peak[stage] = max(self._peak.get(stage, 0), self._held[stage])

    def loss_fn(self, fn, stage_index: int):
        """``fn`` (the schedule's ``loss_fn``) with what it saves for backward (log_softmax's output, the targets)
        added to the micro-batch the last stage ``stage_index`` has just run forward: the schedule computes the loss
        outside ``forward_one_chunk``, but it is that micro-batch's activation memory until its backward."""
        def loss(*args, **kwargs):
            out, nbytes = self._saved_bytes(fn, *args, **kwargs)
            chunk = max((c for s, c in self._bytes if s == stage_index), default=None)
            if chunk is not None:
                self._hold(stage_index, chunk, nbytes)
            return out
        return loss

    def watch(self, stage):
        """Wrap ``stage``'s compute methods (on the instance; the class stays untouched); returns ``stage``."""
        index, forward, backward = stage.stage_index, stage.forward_one_chunk, stage.backward_one_chunk
        weight = stage.backward_weight_one_chunk
        params = {local_storage(p).data_ptr() for p in stage.submod.parameters()}

        def forward_one_chunk(chunk, *args, **kwargs):
            t0 = time.perf_counter()
            out, nbytes = self._saved_bytes(forward, chunk, *args, exclude=params, **kwargs)
            self.record("F", index, chunk, t0)
            self._hold(index, chunk, nbytes)
            return out

        def backward_one_chunk(chunk, *args, **kwargs):
            full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
            t0 = time.perf_counter()
            out = backward(chunk, *args, **kwargs)
            self.record("B" if full else "I", index, chunk, t0)
            self._held[index] -= self._bytes.pop((index, chunk), 0)
            return out

        def backward_weight_one_chunk(chunk, *args, **kwargs):
            t0 = time.perf_counter()
            out = weight(chunk, *args, **kwargs)
            self.record("W", index, chunk, t0)
            return out

        stage.forward_one_chunk, stage.backward_one_chunk = forward_one_chunk, backward_one_chunk
        stage.backward_weight_one_chunk = backward_weight_one_chunk
        return stage


class Stage(nn.Module):
    """A slice of the course's GPT (helpers.rank.gpt.GPT): the blocks ``blocks``, plus the embeddings on the first
    stage and the final LayerNorm + head on the last. Takes the GPT's own modules (no copies)."""

    def __init__(self, gpt, blocks: list[int], first: bool, last: bool):
        super().__init__()
        self.tok_emb, self.pos_emb = (gpt.tok_emb, gpt.pos_emb) if first else (None, None)
        self.blocks = nn.ModuleList(gpt.blocks[i] for i in blocks)
        self.ln_f, self.head = (gpt.ln_f, gpt.head) if last else (None, None)

    def forward(self, x):
        if self.tok_emb is not None:  # x: token ids (b, s); else the previous stage's activations (b, s, d)
            x = self.tok_emb(x) + self.pos_emb(torch.arange(x.size(1), device=x.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x)) if self.head is not None else x  # logits on the last stage


def lm_loss(logits, targets):
    """The GPT's loss (mean next-token cross-entropy, fp32 or wider) from the last stage's logits."""
    return F.cross_entropy(logits.flatten(0, 1).to(torch.promote_types(logits.dtype, torch.float32)),
                           targets.flatten())
