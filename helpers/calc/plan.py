"""Choosing a layout for a GPT: DP x TP x PP, ZeRO and checkpointing, from the course's formulas. Pure arithmetic.

A *layout* places a GPT (``shape``: vocab, seq_len, n_layer, n_head, d_model, attention) on ``dp x tp x pp`` ranks:
``pp`` pipeline stages of equal blocks, or one block fewer on the first and last (:func:`stage_sizes`), each stage's
blocks split over ``tp`` ranks (notebook 09's Megatron plan: the blocks' six weight matrices, ``12 h^2`` per block,
split; the LayerNorms whole; the embeddings and head whole as in the course's scripts, or split over the vocabulary as
Megatron-LM does, which :func:`propose` assumes), and ``dp`` copies of that reading different data, their model states
sharded by ZeRO ``stage`` over the dp ranks. Each step a dp rank runs ``microbatches`` micro-batches of ``micro_batch``
sequences.

Per rank, by stage (:func:`rank_memory`):

    model states   = ZeRO's formula (:func:`helpers.calc.memory.zero_model_state_bytes`) of the stage's parameters
                     on one tp rank (:func:`stage_params`), sharded over dp
    activations    = micro-batches in flight x one micro-batch's bytes of the stage's layers, plus the embeddings'
                     token ids on the first stage and the head's logits on the last (:mod:`helpers.calc.activations`)
    in flight      = GPipe: all m (every forward runs before the first backward);
                     1F1B: min(pp - s, m) on stage s (its warm-up forwards), so at most pp on the first stage

:func:`propose` enumerates the layouts a machine allows (``tp`` a divisor of the GPUs per node and of the heads, ``pp``
splitting the layers, ``dp`` the rest) and returns those that fit in memory, best first, by the order of the Ultra-Scale
Playbook's first step, "fit a training step in memory": the fewest model-parallel ranks ``tp x pp`` (data parallelism
adds the least communication to the critical path); for the same product more TP and less PP, TP inside a node
(Narayanan et al. 2021, arXiv:2104.04473, takeaway #1: TP up to the GPUs per node, then PP); then the lowest ZeRO stage
(ZeRO-3 moves 1.5x the bytes of DP); then the least recomputation. With ``pp > 1`` only ZeRO 0 and 1: DeepSpeed's
pipeline engine asserts "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism"
(``deepspeed/runtime/pipe/engine.py``): they would regather or re-reduce per micro-batch.

:func:`step_comm_bytes`: what one rank sends per step on each axis, by the ring all-reduce's ``2 (n - 1) / n``.

Example::

    shape = dict(vocab=50257, seq_len=2048, n_layer=24, n_head=16, d_model=2048, attention="sdpa")
    best = propose(shape, gpu_bytes=80 * 2**30, n_gpus=8, gpus_per_node=8, global_batch=512)[0]
    best["layout"], best["bytes"] / 2**30    # the layout and its largest stage's GiB per rank
"""
from __future__ import annotations

from . import activations, cp as context
from .memory import PRECISIONS, zero_model_state_bytes

SCHEDULES = ("gpipe", "1f1b", "interleaved")
USABLE = 0.85  # of a GPU's memory the proposal fills: the rest for the CUDA context, the allocator's fragmentation,
#               communication buffers and the temporaries of backward, which the formulas do not count
ADAM_STEP_BYTES = 4  # torch's Adam/AdamW keeps one fp32 step counter per parameter tensor (not in ZeRO's K)


def _dtype(precision: str) -> str:
    return "bf16" if precision == "mixed" else "fp32"


def _vocab_rows(vocab: int, tp: int, vocab_parallel: bool) -> int:
    """The vocabulary rows one TP rank holds of the embedding, the head or the logits: all of them, or with
    ``vocab_parallel`` its ``ceil(V / tp)`` (the vocabulary padded to a multiple of ``tp``)."""
    return -(-vocab // tp) if vocab_parallel else vocab


def stage_sizes(n_layer: int, pp: int) -> list[int] | None:
    """Blocks on each of ``pp`` pipeline stages: equal stages, or, where the layers are two short of equal stages,
    one layer fewer on the first and the last, which also hold the embeddings and the head: Llama 3 405B's 126 layers
    on 16 stages (Llama Team 2024, arXiv:2407.21783, Sec. 3.3.2). None: neither split exists.

        >>> stage_sizes(8, 4), stage_sizes(126, 16)[:3], stage_sizes(126, 16)[-1], stage_sizes(32, 5)
        ([2, 2, 2, 2], [7, 8, 8], 7, None)
    """
    if pp < 1:
        return None
    if n_layer % pp == 0:
        return [n_layer // pp] * pp
    if pp > 2 and (n_layer + 2) % pp == 0:
        per = (n_layer + 2) // pp
        return [per - 1] + [per] * (pp - 2) + [per - 1]
    return None


def _blocks(shape: dict, pp: int, stage: int, virtual: int = 1) -> int:
    """Blocks on rank ``stage`` of ``pp``: its stage's, or with ``virtual`` stages per rank (the interleaved schedule)
    the sum of its chunks ``stage, stage + pp, ...`` of the ``pp x virtual`` (:func:`stage_sizes`)."""
    sizes = stage_sizes(shape["n_layer"], pp * virtual)
    if sizes is None:
        raise ValueError(f"{shape['n_layer']} layers do not split into {pp * virtual} stages, equal or one layer "
                         f"fewer on the first and the last")
    return sum(sizes[stage + k * pp] for k in range(virtual))


def bubble(pp: int, microbatches: int, virtual: int = 1) -> float:
    """The idle fraction of a step: ``(p - 1) / (v m + p - 1)``; ``v`` = 1 for GPipe and 1F1B, the stages per rank
    for the interleaved schedule, whose fill and drain take ``1 / v`` of a stage's time per step (Narayanan et al.
    2021, arXiv:2104.04473, Sec. 2.2.2)."""
    return (pp - 1) / (virtual * microbatches + pp - 1)


def stage_params(shape: dict, pp: int = 1, stage: int = 0, tp: int = 1, vocab_parallel: bool = False,
                 virtual: int = 1) -> int:
    """Parameters one rank of pipeline stage ``stage`` (of ``pp``) holds at tensor-parallel degree ``tp``: per block
    ``12 h^2 / tp + 4 h`` (the six matrices split, two LayerNorms whole), the embeddings ``(V + s) h`` on the first
    stage, the final LayerNorm ``2 h`` and the untied head ``V h`` on the last. The course's scripts keep the
    embeddings and the head whole on every TP rank; ``vocab_parallel`` splits both over the vocabulary as Megatron-LM
    does (its VocabParallelEmbedding, and the head column-parallel): ``ceil(V / tp) h`` each, the vocabulary padded to
    a multiple of ``tp``; the position embedding stays whole. With ``virtual`` stages per rank (the interleaved
    schedule) rank ``stage`` holds chunks ``stage, stage + pp, ...``: the embeddings on rank 0, the head on the last.

        >>> stage_params(dict(vocab=10, seq_len=4, n_layer=2, n_head=2, d_model=4))   # helpers.rank.gpt's count
        520
        >>> stage_params(dict(vocab=10, seq_len=4, n_layer=2, n_head=2, d_model=4), pp=2, stage=1, tp=2)
        160
    """
    h, v = shape["d_model"], shape["vocab"]
    if (12 * h * h) % tp:
        raise ValueError(f"tp {tp} does not divide the blocks' matrices (d_model {h})")
    blocks = _blocks(shape, pp, stage, virtual)
    n = blocks * (12 * h * h // tp + 4 * h)
    rows = _vocab_rows(v, tp, vocab_parallel)
    if stage == 0:
        n += (rows + shape["seq_len"]) * h
    if stage == pp - 1:
        n += 2 * h + rows * h
    return n


def in_flight(schedule: str, pp: int, stage: int, microbatches: int, virtual: int = 1) -> float:
    """Micro-batches whose activations rank ``stage`` holds at once, in whole micro-batches through all its layers:
    GPipe all of them, 1F1B ``min(pp - s, m)``; without a pipeline (``pp`` 1) one: each micro-batch's backward runs
    before the next forward (accumulation). Interleaved (``virtual`` = v >= 2 chunks per rank): Megatron-LM's
    warm-up runs ``2 (pp - s - 1) + (v - 1) pp`` chunk forwards before the first backward, so with the one in
    steady state the rank holds that many chunks plus one, each ``1 / v`` of its layers: ``pp + (pp - 1) / v`` on
    the first rank, more than 1F1B's ``pp`` (Narayanan et al. 2021, Sec. 2.2.2)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if (virtual > 1) != (schedule == "interleaved"):
        raise ValueError(f"virtual stages per rank: 2 or more for the interleaved schedule, 1 for the others; got "
                         f"{virtual} for {schedule}")
    if pp == 1:
        return 1
    if schedule == "interleaved":
        return min(2 * (pp - stage - 1) + (virtual - 1) * pp + 1, virtual * microbatches) / virtual
    return microbatches if schedule == "gpipe" else min(pp - stage, microbatches)


def microbatch_activation_bytes(shape: dict, micro_batch: int, pp: int = 1, stage: int = 0, tp: int = 1,
                                sp: bool = False, dtype: str = "fp32", checkpoint: str = "none",
                                vocab_parallel: bool = False, cp: int = 1, virtual: int = 1) -> float:
    """Bytes one micro-batch leaves saved for backward on one rank of ``stage``: its blocks'
    (:func:`helpers.calc.activations.layer_bytes`), the token and position ids on the first stage, the final
    LayerNorm, logits, log_softmax and targets on the last (:func:`helpers.calc.activations.head_terms`; with
    ``vocab_parallel`` each rank's logits cover ``ceil(V / tp)`` of the vocabulary). With context parallelism
    (``cp`` > 1, notebook 12) all of it at a rank's ``s / cp`` positions, its attention kept as ring attention keeps
    it, what a flash kernel keeps (:func:`helpers.calc.cp.layer_terms_per_rank`)."""
    s, b, h = shape["seq_len"] // cp, micro_batch, shape["d_model"]  # a CP rank's positions
    blocks = _blocks(shape, pp, stage, virtual)
    attention = shape.get("attention", "math") if cp == 1 else "sdpa"  # ring attention keeps what flash keeps
    out = blocks * activations.layer_bytes(s, b, h, shape["n_head"], dtype, attention, checkpoint, tp, sp)
    head = activations.head_terms(s, b, h, _vocab_rows(shape["vocab"], tp, vocab_parallel), dtype)
    ids = activations.INDEX_BYTES * s * b  # the token ids (first stage) or the targets (last)
    if stage == 0:
        out += ids + activations.INDEX_BYTES * s  # and the positions
    if stage == pp - 1:
        out += head["final LayerNorm input and output"] + head["logits and log_softmax"] + ids
    return out


def rank_memory(shape: dict, *, dp: int = 1, tp: int = 1, pp: int = 1, zero: int = 0, checkpoint: str = "none",
                micro_batch: int = 1, microbatches: int = 1, schedule: str = "1f1b", precision: str = "fp32",
                sp: bool = False, step_counters: bool = False, vocab_parallel: bool = False, cp: int = 1,
                virtual: int = 1) -> list[dict]:
    """Per pipeline stage, what one rank holds at its peak: ``params`` (count), the model states ``params_bytes``,
    ``grads``, ``optimizer``, ``in_flight`` micro-batches, ``activations`` and ``total`` (bytes). ``step_counters``:
    add AdamW's fp32 step counter per parameter tensor (:data:`ADAM_STEP_BYTES`, with ``tensors`` per stage
    from :func:`stage_tensors`), to compare with what torch's optimizer measurably keeps. ``vocab_parallel``: the
    embeddings and head split over TP as Megatron-LM does (:func:`stage_params`). ``cp``: context-parallel ranks,
    which hold the same weights as DP ranks do (their gradients are reduced over ``dp x cp``, and ZeRO shards over
    ``dp x cp``, as torchtitan's FSDP does) and each a ``1 / cp`` share of every sequence's activations.
    ``virtual``: chunks per rank of the interleaved schedule (a "stage" is then a rank, its chunks together)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    out = []
    for stage in range(pp):
        n = stage_params(shape, pp, stage, tp, vocab_parallel, virtual)
        states = zero_model_state_bytes(n, dp * cp, zero, precision)
        optimizer = states["optimizer"] + (ADAM_STEP_BYTES * stage_tensors(shape, pp, stage, virtual)
                                           if step_counters else 0)
        held = in_flight(schedule, pp, stage, microbatches, virtual)
        act = held * microbatch_activation_bytes(shape, micro_batch, pp, stage, tp, sp, _dtype(precision), checkpoint,
                                                 vocab_parallel, cp, virtual)
        out.append(dict(stage=stage, params=n, params_bytes=states["params"], grads=states["grads"],
                        optimizer=optimizer, in_flight=held, activations=act,
                        total=states["params"] + states["grads"] + optimizer + act))
    return out


def stage_tensors(shape: dict, pp: int = 1, stage: int = 0, virtual: int = 1) -> int:
    """Parameter tensors of a stage: 10 per block (six matrices, two LayerNorms' weight and bias), 2 embeddings
    on the first stage, the final LayerNorm's two and the head on the last."""
    n = 10 * _blocks(shape, pp, stage, virtual)
    return n + (2 if stage == 0 else 0) + (3 if stage == pp - 1 else 0)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(shape: dict, n_gpus: int, gpus_per_node: int, global_batch: int, micro_batch: int = 1):
    """Every (dp, tp, pp, microbatches) the machine and the model allow: tp divides the GPUs per node and the heads,
    pp splits the layers (:func:`stage_sizes`), dp = n_gpus / (tp pp) divides the global batch into micro-batches, and
    1F1B gets m >= pp."""
    for dp, _cp, tp, pp, m in mesh_layouts(shape, n_gpus, gpus_per_node, global_batch, micro_batch):
        yield dp, tp, pp, m


def mesh_layouts(shape: dict, n_gpus: int, gpus_per_node: int, global_batch: int, micro_batch: int = 1,
                 cps: tuple[int, ...] = (1,)):
    """:func:`layouts` with context parallelism: every (dp, cp, tp, pp, microbatches) for ``cp`` in ``cps`` whose
    zig-zag chunks split the sequence (``2 cp`` of them, notebook 12), with dp = n_gpus / (cp tp pp): the cp ranks
    of a dp rank share its sequences, so dp alone divides the global batch."""
    pps = [p for p in range(1, shape["n_layer"] + 1) if stage_sizes(shape["n_layer"], p)]
    for cp in cps:
        if cp < 1 or (cp > 1 and shape["seq_len"] % (2 * cp)):
            continue
        for tp in _divisors(gpus_per_node):
            if shape["n_head"] % tp:
                continue
            for pp in pps:
                if n_gpus % (cp * tp * pp):
                    continue
                dp = n_gpus // (cp * tp * pp)
                if global_batch % (dp * micro_batch):
                    continue
                m = global_batch // (dp * micro_batch)
                if pp > 1 and m < pp:
                    continue
                yield dp, cp, tp, pp, m


# A DGX H100 node's figures, as the vendor states them: 989 TFLOP/s dense bf16 per H100 SXM GPU; NVLink 4, 900 GB/s
# per GPU in both directions together (450 GB/s each way); one ConnectX-7 NDR port per GPU, 400 Gb/s = 50 GB/s.
# efficiency: the fraction of peak a well-tuned run reaches, Megatron-LM's 52% (163 of 312 TFLOP/s per A100,
# Narayanan et al. 2021, arXiv:2104.04473, Sec. 5.1): an assumption, stated, not a measurement of this machine.
H100_NODE = dict(flops=989e12, efficiency=0.52, nvlink=450e9, network=50e9)


def model_flops(shape: dict, pp: int, global_batch: int) -> dict:
    """A step's FLOPs by Narayanan et al. 2021's count (Sec. 5.1), forward and backward, no recomputation: ``total``,
    ``6 N + 12 L h s`` per token over ``global_batch`` sequences of ``s`` tokens (N: every stage's parameters), and
    its ``attention`` scores' part, ``12 L h s`` per token."""
    L, h, s = shape["n_layer"], shape["d_model"], shape["seq_len"]
    tokens = global_batch * s
    n = sum(stage_params(shape, pp, st, tp=1) for st in range(pp))
    return {"total": (6 * n + 12 * L * h * s) * tokens, "attention": 12 * L * h * s * tokens}


def step_seconds(shape: dict, layout: dict, *, global_batch: int, micro_batch: int, gpus_per_node: int,
                 precision: str = "mixed", hardware: dict = H100_NODE) -> dict:
    """A step's time on ``hardware`` by a first-order model (the Playbook's step 3, "optimise throughput"):

    * ``compute``: 6 N + 12 L h s FLOPs per token (the matmuls, forward and backward, and the attention scores:
      Narayanan et al. 2021's count, Sec. 5.1), over the GPUs at ``efficiency`` of peak; full checkpointing runs the
      forward again (x 4/3); divided by ``1 - bubble`` for a pipeline, its stages taken as balanced (where the first
      and last hold one block fewer, that is the embeddings' and the head's share of the work, as Llama 3 chose it);
      the bubble is :func:`bubble`'s, ``layout["virtual"]`` chunks per rank for the interleaved schedule;
    * ``tp``: the TP all-reduces (:func:`step_comm_bytes`) over NVLink, in the critical path of every layer;
    * ``dp``: the gradient traffic of :func:`step_comm_bytes` over the network when the run spans nodes, NVLink
      otherwise, hidden only behind the compute that runs while it can: ZeRO-0/1 reduce the accumulated gradients
      once, when the last micro-batch's backward produces them, so only that one backward (``1/m`` of the step's
      backward) can hide them; ZeRO-2 reduce-scatters each micro-batch's gradients behind that micro-batch's
      backward (the whole backward); ZeRO-3's gathers also run ahead of the forward (the whole compute). What is
      longer than its cover is ``dp_exposed``;
    * ``cp`` (``layout["cp"]`` > 1): ring attention's blocks (:func:`step_comm_bytes`) over NVLink while ``tp x cp``
      fits in a node, over the network beyond; the ring sends the next block while the current one is attended, so
      only what outlasts the attention's own compute (its ``12 L h s`` FLOPs per token) is ``cp_exposed``;
    * the pipeline's point-to-point sends overlap other micro-batches' compute and are left out.
    """
    dp, tp, pp, m = layout["dp"], layout["tp"], layout["pp"], layout["microbatches"]
    cp, virtual = layout.get("cp", 1), layout.get("virtual", 1)
    n_gpus = dp * tp * pp * cp
    model = model_flops(shape, pp, global_batch)
    flops = model["total"] * (4 / 3 if layout["checkpoint"] == "full" else 1)
    idle = bubble(pp, m, virtual)
    compute = flops / (n_gpus * hardware["flops"] * hardware["efficiency"]) / (1 - idle)
    comm = step_comm_bytes(shape, dp=dp, tp=tp, pp=pp, micro_batch=micro_batch, microbatches=m, precision=precision,
                           zero=layout["zero"], vocab_parallel=layout.get("vocab_parallel", False), cp=cp,
                           virtual=virtual)
    tp_s = comm["tp"] / hardware["nvlink"]
    dp_s = comm["dp"] / (hardware["network"] if n_gpus > gpus_per_node else hardware["nvlink"])
    busy = compute * (1 - idle)  # the compute itself, without the pipeline's idle time
    backward = busy * (3 / 4 if layout["checkpoint"] == "full" else 2 / 3)  # full: the forward rerun, then 2 F
    hidden_behind = {0: backward / m, 1: backward / m, 2: backward, 3: busy}[layout["zero"]]
    exposed = max(0.0, dp_s - hidden_behind)
    cp_s = comm.get("cp", 0.0) / (hardware["nvlink"] if tp * cp <= gpus_per_node else hardware["network"])
    cp_exposed = max(0.0, cp_s - busy * model["attention"] / model["total"])
    return dict(compute=compute, bubble=idle, tp=tp_s, dp=dp_s, dp_exposed=exposed, cp=cp_s, cp_exposed=cp_exposed,
                total=compute + tp_s + exposed + cp_exposed)


def mfu(shape: dict, layout: dict, seconds: float, *, global_batch: int, hardware: dict = H100_NODE) -> float:
    """Model FLOPs utilisation of a step that takes ``seconds``: the model's FLOPs (:func:`model_flops`, recomputation
    not counted: it is work the model did not need) over what the layout's GPUs could do at peak in that time, the
    figure papers report (Llama 3: 38-43%).

        >>> shape = dict(vocab=8, seq_len=4, n_layer=2, n_head=2, d_model=4)
        >>> lay = dict(dp=2, tp=1, pp=1, zero=0, checkpoint="none", microbatches=1)
        >>> round(mfu(shape, lay, step_seconds(shape, lay, global_batch=2, micro_batch=1, gpus_per_node=8)["compute"],
        ...           global_batch=2), 2)
        0.52
    """
    n_gpus = layout["dp"] * layout.get("cp", 1) * layout["tp"] * layout["pp"]
    return model_flops(shape, layout["pp"], global_batch)["total"] / (seconds * n_gpus * hardware["flops"])


def propose(shape: dict, *, gpu_bytes: float, n_gpus: int, gpus_per_node: int, global_batch: int,
            micro_batch: int = 1, precision: str = "mixed", usable: float = USABLE,
            hardware: dict = H100_NODE, cps: tuple[int, ...] = (1,), schedules: tuple[str, ...] = ("1f1b",),
            virtual: int = 2) -> list[dict]:
    """The layouts whose largest stage fits in ``usable x gpu_bytes`` per rank (the Playbook's step 1), fastest
    first by :func:`step_seconds` (its step 3); ties by the order of the module docstring, context-parallel ranks
    counted with the model-parallel ones. Each: ``layout`` (dp, cp, tp, pp, zero, checkpoint, sp, microbatches,
    schedule), ``bytes`` (the largest stage's total per rank), ``bubble``, ``seconds`` (:func:`step_seconds`),
    ``stages`` (:func:`rank_memory`). ``cps``: the context-parallel degrees to consider (:func:`mesh_layouts`).
    ``schedules``: the pipeline schedules to consider where ``pp`` > 1, "1f1b" and "interleaved" (``virtual``
    chunks per rank, where the layers split into ``pp x virtual`` stages and ``pp`` divides the micro-batches, as
    Megatron-LM requires)."""
    if n_gpus < 1 or gpus_per_node < 1 or (n_gpus > gpus_per_node and n_gpus % gpus_per_node):
        raise ValueError(f"need n_gpus a multiple of gpus_per_node (or fewer), got {n_gpus} and {gpus_per_node}")
    node = min(gpus_per_node, n_gpus)
    fits = []
    for dp, cp, tp, pp, m, schedule, v in _scheduled(mesh_layouts(shape, n_gpus, node, global_batch, micro_batch,
                                                                   cps), shape, schedules, virtual):
        for zero in (0, 1) if pp > 1 else (0, 1, 2, 3):
            for rank, checkpoint in enumerate(activations.CHECKPOINTS):
                layout = dict(dp=dp, cp=cp, tp=tp, pp=pp, zero=zero, checkpoint=checkpoint, sp=tp > 1, microbatches=m,
                              schedule=schedule, virtual=v, vocab_parallel=tp > 1)
                stages = rank_memory(shape, dp=dp, tp=tp, pp=pp, zero=zero, checkpoint=checkpoint,
                                     micro_batch=micro_batch, microbatches=m, schedule=schedule, precision=precision,
                                     sp=tp > 1, vocab_parallel=tp > 1, cp=cp, virtual=v)
                worst = max(st["total"] for st in stages)
                if worst <= usable * gpu_bytes:
                    t = step_seconds(shape, layout, global_batch=global_batch, micro_batch=micro_batch,
                                     gpus_per_node=node, precision=precision, hardware=hardware)
                    fits.append(dict(layout=layout, bytes=worst, bubble=t["bubble"], seconds=t, stages=stages,
                                     key=(round(t["total"], 9), cp * tp * pp, -tp, zero, rank)))
    return sorted(fits, key=lambda f: f["key"])


def _scheduled(meshes, shape: dict, schedules: tuple[str, ...], virtual: int):
    """Each mesh of :func:`mesh_layouts` with the schedules it allows: (dp, cp, tp, pp, m, schedule, virtual)."""
    for dp, cp, tp, pp, m in meshes:
        if pp == 1:
            yield dp, cp, tp, pp, m, "1f1b", 1
            continue
        for schedule in schedules:
            if schedule == "interleaved":
                if virtual >= 2 and m % pp == 0 and stage_sizes(shape["n_layer"], pp * virtual):
                    yield dp, cp, tp, pp, m, schedule, virtual
            elif schedule in SCHEDULES:
                yield dp, cp, tp, pp, m, schedule, 1
            else:
                raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")


def step_comm_bytes(shape: dict, *, dp: int = 1, tp: int = 1, pp: int = 1, micro_batch: int = 1,
                    microbatches: int = 1, precision: str = "fp32", zero: int = 0,
                    vocab_parallel: bool = False, cp: int = 1, virtual: int = 1) -> dict:
    """Bytes one rank sends per step on each axis (for ``dp``, a rank of the first stage, whose embeddings make it
    hold the most parameters, :func:`stage_params` with ``vocab_parallel``; for ``pp``, a middle stage's, which
    sends both ways):

    * ``tp``: 4 all-reduces of a micro-batch's activations (s b h) per block, two in forward (after the attention
      projection and the MLP's down matrix) and two in backward, each ``2 (tp - 1) / tp`` of the tensor;
    * ``pp``: the activation sent forward and the gradient sent back, per micro-batch, and ``virtual`` times that
      with the interleaved schedule (a micro-batch passes each rank once per chunk);
    * ``dp`` over the stage's ``n`` gradient bytes, by ZeRO stage: 0 and 1 all-reduce the accumulated gradients
      once per step, ``2 (dp - 1) / dp x n``; 2 reduce-scatters each micro-batch's gradients as they are produced
      (it keeps only its shard), ``m (dp - 1) / dp x n``; 3 also all-gathers the parameters for each micro-batch's
      forward and again for its backward, ``3 m (dp - 1) / dp x n`` (ZeRO's 1.5x of DP, once per micro-batch).

    With context parallelism (``cp`` > 1) a rank's activations are ``s / cp`` positions, the gradients are reduced
    over ``dp x cp`` ranks (in place of ``dp`` above), and a ``cp`` entry is added: ring attention's K and V blocks
    per block and micro-batch (:func:`helpers.calc.cp.ring_bytes_per_layer`, forward and backward), of the heads
    this TP rank holds, and of ``n_kv_head`` of them where the shape gives it (grouped-query attention: Llama 3
    has 8 K/V heads for 128 query heads, so its blocks are 16x smaller than its width says).
    """
    e = activations.DTYPE_BYTES[_dtype(precision)]
    s, h = shape["seq_len"] // cp, shape["d_model"]
    act = e * s * micro_batch * h
    blocks = max(_blocks(shape, pp, st, virtual) for st in range(pp))  # the stage that holds the most blocks
    grads = PRECISIONS[precision][1] * stage_params(shape, pp, 0, tp, vocab_parallel, virtual)
    reduced = dp * cp  # the ranks that hold the same weights
    out = {"tp": microbatches * blocks * 4 * act * 2 * (tp - 1) / tp,
           "pp": microbatches * 2 * act * virtual if pp > 1 else 0.0,
           "dp": grads * (reduced - 1) / reduced * {0: 2, 1: 2, 2: microbatches, 3: 3 * microbatches}[zero]}
    if cp > 1:
        kv = h * shape.get("n_kv_head", shape["n_head"]) // shape["n_head"] // tp  # K or V features of a TP rank
        ring = context.ring_bytes_per_layer(micro_batch, shape["seq_len"], kv, cp, e)
        out["cp"] = microbatches * blocks * (ring["forward"] + ring["backward"])
    return out
