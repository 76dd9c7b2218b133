"""Metrics written by rank processes and read back by notebooks.

Rank side: :class:`Reporter` appends one JSON object per line to ``<run_dir>/metrics.jsonl``.
Every record carries ``rank``, ``t`` (unix seconds) and ``kind``:

* ``kind="step"``  -- a training/benchmark step: ``step`` plus free fields (``loss``, ``samples``...).
* ``kind="total"`` -- how many steps rank 0 will run (``steps``) after which step it starts (``start``, 0 unless
  resumed): the launcher's progress bar shows ``step - start`` of ``steps``.
* ``kind="result"`` -- final facts of the run (accuracy, checkpoint path...), merged into ``Run.result``.
* ``kind="event"`` -- anything else worth recording (``name`` plus fields).

The run directory comes from the ``HELPERS_RUN_DIR`` variable that :mod:`helpers.launch` sets, or
from the ``run_dir`` argument. Run from a plain terminal without either, the reporter is a no-op,
so course scripts stay runnable with bare ``torchrun``.

**The schema is enforced where it is written.** Step and result fields must be fields of :class:`TrainStep` /
:class:`TrainResult`, of the annotated type (or None): anything else raises :class:`SchemaError` naming the field
and the closest defined one, so a new script cannot drift. Demos and probes that report facts of their own say so
with ``Reporter(schema=None)``.

**Steps are numbered from 1**: a step's number is how many steps are done when it ends, in every script (and
``step_s`` is its wall time). ``samples_per_s`` is steady-state throughput as :mod:`helpers.calc.throughput` defines
it (the one definition: samples per step / median of the slowest rank's step time after the warm-up steps).

Example (inside a rank)::

    rep = Reporter()
    rep.total(100)
    for step in range(1, 101):
        ...
        rep.step(step, loss=loss.item(), samples=batch_size)
    rep.result(test_accuracy=0.71)
"""
from __future__ import annotations

import difflib
import json
import os
import time
from pathlib import Path
from typing import Any, Iterable, TypedDict, get_type_hints

METRICS_FILE = "metrics.jsonl"


class TrainStep(TypedDict, total=False):
    """The fields of a ``kind="step"`` record of a training script (``Reporter.step``); units in the names.

    Memory is in MiB (2**20 bytes) everywhere in this course, and the field names say so.
    """

    step: int             # steps done when it ended, from 1 (micro batches for ds_cifar10.py, optimizer steps else)
    loss: float           # this rank's training loss of the step (the accumulated mean with --accumulation)
    samples: int          # samples this rank processed in the step
    epoch: int            # the epoch the step belongs to
    lr: float             # the learning rate the step's optimizer update used
    grad_norm: float      # global gradient norm before clipping
    optimizer_step: int   # DeepSpeed: optimizer steps taken so far (engine.global_steps)
    step_s: float         # wall seconds of the step, measured on this rank (synchronised on GPUs)
    attempt: int          # elastic: which start of the worker group (0 = first) ran the step
    rss_mib: float        # resident memory of the rank process sampled at the end of the step (psutil)
    cuda_mib: float       # CUDA memory allocated at the end of the step (torch.cuda.memory_allocated)
    cuda_peak_mib: float  # CUDA high-water mark since the process started (torch.cuda.max_memory_allocated)
    checkpoint_mode: str  # gpt_memory.py: the activation checkpointing the step ran with (none/selective/full)


class TrainResult(TypedDict, total=False):
    """The fields of ``kind="result"`` records of the training scripts (``Reporter.result``), read by notebooks.

    Rank 0 writes the run's facts; every rank writes what it measured of itself (``model_state_bytes``,
    ``comm_per_step``), read back per rank with ``Run.results_by_rank()``.
    """

    framework: str            # "ddp", "deepspeed" (and the FSDP2 chapter's "fsdp2")
    world_size: int           # ranks in the job
    global_batch: int         # samples behind one optimizer step, across all ranks
    params: int               # trainable parameters of the model (before any sharding)
    dtype: str                # training precision: "fp32", "bf16", "fp16", or "bf16-autocast"
    zero_stage: int           # DeepSpeed's ZeRO stage
    offload: str              # DeepSpeed's ZeRO offload ("optimizer", "param", "both") or None
    dataset: str              # "cifar10" or "synthetic" (generated data is never called CIFAR-10)
    test_accuracy: float      # accuracy on the whole test set, 0..1
    train_samples: int        # samples trained on, all ranks together
    train_seconds: float      # wall seconds of the training loop on rank 0
    samples_per_s: float      # steady-state throughput, all ranks together (helpers.calc.throughput: samples per step
                              # / median over the steps after --skip-steps of the slowest rank's step_s)
    timed_steps: int          # steps behind samples_per_s: this run's steps after the warm-up ones
    first_step_s: float       # wall seconds of the first step (start-up costs: allocator, compile, first bucket)
    optimizer_steps: int      # optimizer steps taken
    compiled: bool            # the model ran under torch.compile
    checkpoint: str           # path of the saved checkpoint (file or folder)
    checkpoint_bytes: int     # its size on disk
    rss_start_mib: float      # resident memory before the model existed: the framework's own share
    peak_rss_mib: float       # the rank's resident-memory high-water mark (getrusage ru_maxrss) at the end
    cuda_peak_mib: float      # the rank's CUDA high-water mark at the end (torch.cuda.max_memory_allocated)
    model_state_bytes: dict   # helpers.rank.state.model_state_bytes: params, grads, optimizer, total, buffers
    comm_per_step: dict       # {collective: {"calls", "bytes"}} this rank handed to collectives per optimizer step
    steps: int                # elastic: steps the run ended at (counted across restarts)
    restart_count: int        # elastic: how often torchrun restarted the worker group (TORCHELASTIC_RESTART_COUNT)
    resumed_from: int         # elastic: the step of the snapshot the last start resumed from, or None
    final_params_sha256: str  # elastic: SHA-256 of the final state_dict, to compare runs bitwise
    reshard_after_forward: bool  # FSDP2: gathered parameters freed after forward (ZeRO-3-like) or kept (ZeRO-2-like)
    exported: str             # FSDP2: path of the plain state_dict file converted from the DCP checkpoint
    shard_size: int           # FSDP2: ranks each copy is sharded over (= world_size, or fewer with HSDP replicas)
    test_loss: float          # GPT: mean next-character cross-entropy on held-out text, nats per character
    unigram_loss: float       # GPT: the baseline: cross-entropy of the training text's character frequencies (nats)
    vocab_size: int           # GPT: distinct characters (tokens) of the text
    gpt: dict                 # GPT: the model's shape, helpers.rank.gpt.GPTConfig.as_dict()
    tp_degree: int            # TP: ranks each layer is split over (course/gpt_tp.py --tp)
    dp_degree: int            # TP: data-parallel ranks (world_size / tp_degree; FSDP2 over them when > 1)
    sequence_parallel: bool   # TP: the LayerNorm regions sharded along the sequence (--sp)
    tp_rank: int              # TP: this rank's place on the mesh's "tp" dimension (which tensor shard)
    dp_rank: int              # TP: this rank's place on the mesh's "dp" dimension (which data shard)
    shard_shapes: dict        # TP: {parameter name: the shape this rank holds (list of ints)}
    tp_comm_calls: dict       # TP: {"forward"|"backward"|"grad_sync": {collective: calls}} of one step, CommDebugMode
    tp_saved_bytes: list      # TP: per block, the bytes of activations it saved for backward on this rank (local shards)
    activations: list         # gpt_memory.py: per measured shape, its GPT shape (seq_len, batch, d_model, n_head, n_layer,
                              # vocab, attention, dtype, checkpoint) and act_bytes: bytes MemTracker labels activations
                              # right after the forward (what autograd keeps for backward)
    checkpointing: dict       # gpt_memory.py: per checkpoint mode, act_bytes (as above) and step_s: the timed steps'
                              # wall seconds (modes interleaved, warm-up steps left out)
    peak_split: dict          # gpt_memory.py: MemTracker's peak of one training step by kind (param, grad, opt, act,
                              # temp, buffer, oth), bytes
    peak_phase: str           # gpt_memory.py: the phase of the step that peak fell in (forward, backward, optimizer step)
    meta_init_equal: bool     # gpt_memory.py: a GPT built on the meta device + to_empty + init_weights(seed) equals
                              # lm.build_gpt's, tensor for tensor
    pp_schedule: str          # PP: the torch.distributed.pipelining schedule (gpt_pp.py --schedule; "none": one process)
    pp_degree: int            # PP: pipeline ranks
    pp_num_stages: int        # PP: stages in all (pp_degree, or 2 x for the interleaved and V-shaped schedules)
    pp_microbatches: int      # PP: micro-batches per step (--microbatches)
    pp_loss_rank: int         # PP: the rank holding the last stage, where the loss is computed (then broadcast)
    pp_stages: list           # PP: the stage indices this rank holds
    pp_timeline: list         # PP: this rank's actions, [step, kind F/B/I/W, stage, micro-batch, t0 s, t1 s], seconds
                              # since the step began (a barrier on every rank)
    pp_planned: dict          # PP: the schedule's own plan, {rank: [action or None per slot]}, str(torch _Action) such
                              # as "1F3" (stage 1, forward, micro-batch 3); pipeline_order (_get_pipeline_order)
    pp_saved_bytes: dict      # PP: {stage: most bytes of saved activations (saved_tensors_hooks) held at once}, bytes
    rank_state_bytes: dict    # 3-D: {params, grads, optimizer}: bytes this rank holds after its first step (a DTensor's
                              # local shard: elements x element size)
    ddp_sync: str             # overlap.py: how the gradients are averaged (its --mode: "buckets", "fsdp2", ...)
    bucket_cap_mb: float      # overlap.py: DDP's bucket_cap_mb, MiB
    grad_mib: float           # overlap.py: the model's gradients in all, MiB
    ddp_buckets: list         # overlap.py: the sizes of DDP's gradient buckets after its first step, bytes, in the
                              # order they are all-reduced (_get_ddp_logging_data()["rebuilt_bucket_sizes"])
    cp_degree: int            # CP: ranks each sequence is split over (course/gpt_cp.py --cp; dp_degree: the rest)
    cp_rank: int              # CP: this rank's place on the mesh's "cp" dimension (which positions it holds)
    cp_attention: str         # CP: how attention sees the whole sequence: "ring" or "ulysses" (--attn)
    cp_layout: str            # CP: which positions a rank holds: "zigzag" (chunks r, 2cp-1-r) or "contiguous"
    cp_positions: list        # CP: the positions of every sequence this rank holds (ints, ascending)
    cp_per_step: dict         # CP: this rank's attention per training step, {"forward"|"backward": {sent_bytes,
                              # recv_bytes, blocks_computed, blocks_skipped, work_pairs (query-key pairs computed, x
                              # batch x heads), compute_s (seconds)}} (helpers.rank.cp.STATS)
    cp_formula: dict          # CP: helpers.calc.cp for this rank per step: {"forward"|"backward": bytes sent,
                              # "work_pairs": forward pairs x batch x heads} (None under --attn torch: not counted)
    cp_act_bytes: int         # CP: bytes MemTracker labels activations on this rank right after one forward of
                              # its positions (before any backward): saved for the backward, plus the logits and loss
                              # (None under --attn torch)
    cp_parity: dict           # CP: one step's loss and gradients (after the sync) against one process on the unsplit
                              # batch: {loss_gap, grad_gap, loss_floor, grad_floor (fp32 vs fp64 of that process),
                              # loss_bound, grad_bound, ok}; in the loss's units (nats) and the gradients'
    moe_ep_degree: int        # MoE: ranks the experts are split over (course/gpt_moe.py --ep; dp_degree: their replicas)
    moe_ep_rank: int          # MoE: this rank's place on the mesh's "ep" dimension (which experts it holds)
    moe_experts: int          # MoE: experts per MoE layer, E (--experts)
    moe_top_k: int            # MoE: experts each token is routed to, k (--top-k)
    moe_capacity_factor: float  # MoE: an expert takes at most ceil(factor x tokens x k / E) of a rank's assignments
    moe_aux_weight: float     # MoE: weight of the load-balancing loss E x sum_e f_e P_e in the training loss
    moe_local_experts: list   # MoE: the global ids of the experts this rank holds (the same in every layer)
    moe_per_step: dict        # MoE: this rank's MoE layers per training step, every layer summed (moe.STATS): {sent_bytes:
                              # {"dispatch"|"combine": {"forward"|"backward": bytes to other ranks}},
                              # count_bytes (the per-expert counts exchanged, bytes), tokens_per_expert (list, E: this
                              # rank's assignments per expert before dropping), processed ({expert id: rows its expert
                              # computed here}), dropped (assignments over capacity), rows: {sent, received}: token
                              # rows to / from other ranks in the forward dispatch}
    moe_formula: dict         # MoE: helpers.calc.moe.measured_bytes_per_layer from this rank's rows: the bytes sent_bytes
                              # must equal, {"dispatch"|"combine": {"forward"|"backward": bytes}} per step
    moe_uniform: dict         # MoE: helpers.calc.moe.uniform_bytes_per_layer x n_layer: the same bytes under uniform
                              # routing and no drops ((ep-1)/ep of the tokens x k leave the rank)
    moe_params: dict          # MoE: helpers.calc.moe.parameters: {dense, total (every expert), active (k experts per
                              # token), per_rank (E / ep experts: what this rank holds)}, parameters
    moe_grad_norms: dict      # MoE: after the parity step's sync, L2 norm of this rank's gradients: {"dense": of the
                              # replicated parameters, "experts": {expert id: of that expert's}}: dense equal on every
                              # rank, an expert's equal on its dp replicas
    moe_parity: dict          # MoE: one step's loss and gradients (after the sync) against one process holding every
                              # expert on the whole global batch (capacity per rank-sized group): as cp_parity
RUN_DIR_ENV = "HELPERS_RUN_DIR"


class SchemaError(ValueError):
    """A rank reported a field the schema does not define, or a value of the wrong type."""


_SCHEMAS = {"step": TrainStep, "result": TrainResult}
_HINTS = {kind: get_type_hints(schema) for kind, schema in _SCHEMAS.items()}  # once: check_fields runs every step
_OK_TYPES = {float: (int, float), int: (int,), bool: (bool,), str: (str,), dict: (dict,)}


def check_fields(kind: str, fields: dict) -> None:
    """Raise :class:`SchemaError` unless every field is one :class:`TrainStep` (kind "step") or
    :class:`TrainResult` (kind "result") defines, with a value of its type or None."""
    schema, hints = _SCHEMAS[kind], _HINTS[kind]
    for name, value in fields.items():
        if name not in hints:
            close = difflib.get_close_matches(name, list(hints), n=1)
            hint = f" -- did you mean {close[0]!r}?" if close else ""
            raise SchemaError(f"{kind} field {name!r} is not in helpers.rank.metrics.{schema.__name__}{hint} "
                              f"(add it there, with its unit, if it is a new quantity)")
        want = hints[name]
        if value is None:
            continue
        ok = _OK_TYPES.get(want, (want,))
        if not isinstance(value, ok) or (want is not bool and isinstance(value, bool)):
            raise SchemaError(f"{kind} field {name!r} must be {want.__name__} (or None), "
                              f"got {value!r} ({type(value).__name__})")


def _rank_from_env() -> int:
    return int(os.environ.get("RANK", "0"))


def _jsonable(value: Any) -> Any:
    """Tensors and numpy scalars become plain Python numbers; everything else passes through."""
    if hasattr(value, "item") and callable(value.item):
        try:
            return value.item()
        except (ValueError, RuntimeError):
            pass
    if hasattr(value, "tolist"):
        return value.tolist()
    return value


class Reporter:
    """Append-only JSON-lines writer, safe to share between ranks.

    Each record is written with a single ``os.write`` on an ``O_APPEND`` descriptor, so lines from
    different ranks never interleave (POSIX appends of one small buffer are atomic on a local file).
    """

    def __init__(self, run_dir: str | os.PathLike | None = None, rank: int | None = None, schema: str | None = "train"):
        self.schema = schema
        run_dir = run_dir if run_dir is not None else os.environ.get(RUN_DIR_ENV)
        self.rank = _rank_from_env() if rank is None else int(rank)
        self.path = Path(run_dir) / METRICS_FILE if run_dir else None
        self._fd = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, kind: str, **fields: Any) -> None:
        values = {k: _jsonable(v) for k, v in fields.items()}
        if self.schema is not None and kind in _SCHEMAS:
            check_fields(kind, values)  # also without a run directory: a terminal run finds the typo too
        if self._fd is None:
            return
        record = {"kind": kind, "rank": self.rank, "t": time.time()}
        record.update(values)
        os.write(self._fd, (json.dumps(record) + "\n").encode())

    def step(self, step: int, **fields: Any) -> None:
        self.write("step", step=int(step), **fields)

    def total(self, steps: int, start: int = 0) -> None:
        self.write("total", steps=int(steps), start=int(start))

    def result(self, **fields: Any) -> None:
        self.write("result", **fields)

    def event(self, name: str, **fields: Any) -> None:
        self.write("event", name=name, **fields)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """All complete records of a run, in file order. A torn last line (rank killed mid-write) is skipped."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def steps(records: Iterable[dict], rank: int | None = None) -> list[dict]:
    """The ``step`` records, optionally of one rank, sorted by (rank, step)."""
    out = [r for r in records if r.get("kind") == "step" and (rank is None or r.get("rank") == rank)]
    return sorted(out, key=lambda r: (r.get("rank", 0), r.get("step", 0)))


def results(records: Iterable[dict]) -> dict:
    """Merge the ``result`` records: rank 0's values win, other ranks fill keys rank 0 did not set."""
    merged: dict = {}
    for r in sorted((r for r in records if r.get("kind") == "result"), key=lambda r: -r.get("rank", 0)):
        merged.update({k: v for k, v in r.items() if k not in ("kind", "t")})
    merged.pop("rank", None)
    return merged


def series(records: Iterable[dict], field: str, rank: int = 0) -> tuple[list[int], list[float]]:
    """(steps, values) of one field for one rank, for plotting."""
    xs, ys = [], []
    for r in steps(records, rank):
        if field in r:
            xs.append(r["step"])
            ys.append(r[field])
    return xs, ys
