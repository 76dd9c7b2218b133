"""Choosing a layout for a GPT: DP x CP x TP x PP (x EP for a mixture of experts), ZeRO, the pipeline schedule and
checkpointing, from the course's formulas. Pure arithmetic.

What one rank of a layout holds is :mod:`helpers.calc.stages` (re-exported here: ``plan.rank_memory`` and the rest).
This module enumerates the layouts a machine allows (:func:`layouts`, :func:`mesh_layouts`: ``tp`` a divisor of the
GPUs per node and of the heads, ``pp`` splitting the layers, ``cp`` the sequence, ``dp`` the rest), models a step's
time on a stated machine (:func:`step_seconds`, :func:`mfu`) from what each axis sends (:func:`step_comm_bytes`, by
the ring all-reduce's ``2 (n - 1) / n``), and :func:`propose` returns the layouts that fit in memory (the Ultra-Scale
Playbook's first step, "fit a training step in memory"), fastest first by the model (its step 3), ties broken by the
fewest model-parallel ranks (data parallelism adds the least communication to the critical path), more TP for the
same product (Narayanan et al. 2021, arXiv:2104.04473, takeaway #1: TP up to the GPUs per node, then PP), fewer EP
ranks, the lowest ZeRO stage and the least recomputation. With ``pp > 1`` only ZeRO 0 and 1: DeepSpeed's pipeline
engine asserts "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism" (``deepspeed/runtime/pipe/engine.py``):
they would regather or re-reduce per micro-batch.

Example::

    shape = dict(vocab=50257, seq_len=2048, n_layer=24, n_head=16, d_model=2048, attention="sdpa")
    best = propose(shape, gpu_bytes=80 * 2**30, n_gpus=8, gpus_per_node=8, global_batch=512)[0]
    best["layout"], best["bytes"] / 2**30    # the layout and its largest stage's GiB per rank
"""
from __future__ import annotations

from . import activations, cp as context, moe as experts_calc
from .memory import PRECISIONS
from .stages import (ADAM_STEP_BYTES, SCHEDULES, _blocks, _dtype, active_params, block_params,  # noqa: F401
                     bubble, in_flight, is_moe, microbatch_activation_bytes, mlp_activation_bytes, rank_layers,
                     rank_memory, stage_param_split, stage_params, stage_sizes, stage_tensors)

USABLE = 0.85  # of a GPU's memory the proposal fills: the rest for the CUDA context, the allocator's fragmentation,
#               communication buffers and the temporaries of backward, which the formulas do not count


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
    ``6 N + 12 L h s`` per token over ``global_batch`` sequences of ``s`` tokens (N: the parameters a token uses,
    :func:`active_params`: all of them, or of a mixture of experts its top-k experts), and its ``attention`` scores'
    part, ``12 L h s`` per token."""
    L, h, s = shape["n_layer"], shape["d_model"], shape["seq_len"]
    tokens = global_batch * s
    n = active_params(shape)
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
    * ``ep`` (``layout["ep"]`` > 1, a mixture of experts): the all-to-alls of :func:`step_comm_bytes` over NVLink
      while ``tp x cp x ep`` fits in a node, over the network beyond, all of it exposed: a micro-batch's experts
      wait for its dispatch and its next block for the combine (DeepSeek-V3's DualPipe hides them behind another
      micro-batch's compute, and its node-limited routing sends each token to at most 4 nodes: neither is modelled);
    * the pipeline's point-to-point sends overlap other micro-batches' compute and are left out.
    """
    dp, tp, pp, m = layout["dp"], layout["tp"], layout["pp"], layout["microbatches"]
    cp, virtual, ep = layout.get("cp", 1), layout.get("virtual", 1), layout.get("ep", 1)
    n_gpus = dp * tp * pp * cp
    model = model_flops(shape, pp, global_batch)
    flops = model["total"] * (4 / 3 if layout["checkpoint"] == "full" else 1)
    idle = bubble(pp, m, virtual)
    compute = flops / (n_gpus * hardware["flops"] * hardware["efficiency"]) / (1 - idle)
    comm = step_comm_bytes(shape, dp=dp, tp=tp, pp=pp, micro_batch=micro_batch, microbatches=m, precision=precision,
                           zero=layout["zero"], vocab_parallel=layout.get("vocab_parallel", False), cp=cp,
                           virtual=virtual, ep=ep, checkpoint=layout["checkpoint"])
    tp_s = comm["tp"] / hardware["nvlink"]
    dp_s = comm["dp"] / (hardware["network"] if n_gpus > gpus_per_node else hardware["nvlink"])
    busy = compute * (1 - idle)  # the compute itself, without the pipeline's idle time
    backward = busy * (3 / 4 if layout["checkpoint"] == "full" else 2 / 3)  # full: the forward rerun, then 2 F
    hidden_behind = {0: backward / m, 1: backward / m, 2: backward, 3: busy}[layout["zero"]]
    exposed = max(0.0, dp_s - hidden_behind)
    cp_s = comm.get("cp", 0.0) / (hardware["nvlink"] if tp * cp <= gpus_per_node else hardware["network"])
    cp_exposed = max(0.0, cp_s - busy * model["attention"] / model["total"])
    ep_s = comm.get("ep", 0.0) / (hardware["nvlink"] if tp * cp * ep <= gpus_per_node else hardware["network"])
    return dict(compute=compute, bubble=idle, tp=tp_s, dp=dp_s, dp_exposed=exposed, cp=cp_s, cp_exposed=cp_exposed,
                ep=ep_s, total=compute + tp_s + exposed + cp_exposed + ep_s)


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
            virtual: int = 2, eps: tuple[int, ...] | None = None) -> list[dict]:
    """The layouts whose largest stage fits in ``usable x gpu_bytes`` per rank (the Playbook's step 1), fastest
    first by :func:`step_seconds` (its step 3); ties by the order of the module docstring, context-parallel ranks
    counted with the model-parallel ones. Each: ``layout`` (dp, cp, tp, pp, zero, checkpoint, sp, microbatches,
    schedule), ``bytes`` (the largest stage's total per rank), ``bubble``, ``seconds`` (:func:`step_seconds`),
    ``stages`` (:func:`rank_memory`). ``cps``: the context-parallel degrees to consider (:func:`mesh_layouts`).
    ``schedules``: the pipeline schedules to consider where ``pp`` > 1, "1f1b" and "interleaved" (``virtual``
    chunks per rank, where the layers split into ``pp x virtual`` stages and ``pp`` divides the micro-batches, as
    Megatron-LM requires). ``eps``: the expert-parallel degrees to consider for a mixture of experts (default:
    every divisor of its experts), each where it divides ``dp x cp``; 1 for a dense model."""
    if n_gpus < 1 or gpus_per_node < 1 or (n_gpus > gpus_per_node and n_gpus % gpus_per_node):
        raise ValueError(f"need n_gpus a multiple of gpus_per_node (or fewer), got {n_gpus} and {gpus_per_node}")
    node = min(gpus_per_node, n_gpus)
    if eps is None:
        eps = tuple(_divisors(shape["moe"]["experts"])) if "moe" in shape else (1,)
    fits = []
    meshes = _scheduled(mesh_layouts(shape, n_gpus, node, global_batch, micro_batch, cps), shape, schedules, virtual)
    for dp, cp, tp, pp, m, schedule, v, ep, zero in _with_ep_and_zero(meshes, shape, eps):
        for rank, checkpoint in enumerate(activations.CHECKPOINTS):
            layout = dict(dp=dp, cp=cp, tp=tp, pp=pp, zero=zero, checkpoint=checkpoint, sp=tp > 1, microbatches=m,
                          schedule=schedule, virtual=v, vocab_parallel=tp > 1, ep=ep)
            stages = rank_memory(shape, dp=dp, tp=tp, pp=pp, zero=zero, checkpoint=checkpoint,
                                 micro_batch=micro_batch, microbatches=m, schedule=schedule, precision=precision,
                                 sp=tp > 1, vocab_parallel=tp > 1, cp=cp, virtual=v, ep=ep)
            worst = max(st["total"] for st in stages)
            if worst <= usable * gpu_bytes:
                t = step_seconds(shape, layout, global_batch=global_batch, micro_batch=micro_batch,
                                 gpus_per_node=node, precision=precision, hardware=hardware)
                fits.append(dict(layout=layout, bytes=worst, bubble=t["bubble"], seconds=t, stages=stages,
                                 key=(round(t["total"], 9), cp * tp * pp, -tp, ep, zero, rank)))
    return sorted(fits, key=lambda f: f["key"])


def _with_ep_and_zero(scheduled, shape: dict, eps: tuple[int, ...]):
    """Each of :func:`_scheduled`'s with the expert-parallel degrees (dividing the experts and ``dp x cp``) and the
    ZeRO stages it allows (0 and 1 with a pipeline): (dp, cp, tp, pp, m, schedule, virtual, ep, zero)."""
    for mesh in scheduled:
        dp, cp, pp = mesh[0], mesh[1], mesh[3]
        for ep in eps:
            if (dp * cp) % ep or (ep > 1 and ("moe" not in shape or shape["moe"]["experts"] % ep)):
                continue
            for zero in (0, 1) if pp > 1 else (0, 1, 2, 3):
                yield (*mesh, ep, zero)


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
                    vocab_parallel: bool = False, cp: int = 1, virtual: int = 1, ep: int = 1,
                    stage: int | None = None, checkpoint: str = "none") -> dict:
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

    A mixture of experts (``shape["moe"]``): the routed experts' gradients are reduced over the ``dp x cp / ep``
    ranks that hold the same experts, the rest over ``dp x cp``; and an ``ep`` entry: per MoE block and micro-batch
    the four all-to-alls of notebook 13 (dispatch and combine, forward and backward) under balanced routing,
    ``4 T k h e (ep - 1) / ep`` (:func:`helpers.calc.moe.uniform_bytes_per_layer`), T the tokens this rank routes:
    the micro-batch's ``s / cp`` positions, ``1 / tp`` of them with TP (sequence parallelism), as Megatron-LM does;
    for the stage with the most MoE blocks, or for ``stage``. With ``checkpoint="full"`` the recomputed forward
    sends its dispatch and combine again: six all-to-alls (course/gpt_at_scale.py counts them). The TP all-reduces
    that a recomputed forward repeats are not counted.
    """
    e = activations.DTYPE_BYTES[_dtype(precision)]
    s, h = shape["seq_len"] // cp, shape["d_model"]
    act = e * s * micro_batch * h
    blocks = max(_blocks(shape, pp, st, virtual) for st in range(pp))  # the stage that holds the most blocks
    split = stage_param_split(shape, pp, 0, tp, vocab_parallel, virtual, ep)
    reduced = dp * cp  # the ranks that hold the same weights (the same experts: dp x cp / ep of them)
    times = {0: 2, 1: 2, 2: microbatches, 3: 3 * microbatches}[zero]
    dp_bytes = sum(PRECISIONS[precision][1] * n * (r - 1) / r * times
                   for n, r in ((split["dense"], reduced), (split["experts"], reduced // ep)) if n)
    out = {"tp": microbatches * blocks * 4 * act * 2 * (tp - 1) / tp,
           "pp": microbatches * 2 * act * virtual if pp > 1 else 0.0,
           "dp": dp_bytes}
    if "moe" in shape:
        moe_blocks = max(sum(is_moe(shape, i) for i in rank_layers(shape, pp, st, virtual))
                         for st in (range(pp) if stage is None else [stage]))
        exchanges = experts_calc.uniform_bytes_per_layer(s * micro_batch // tp, shape["moe"]["top_k"], h, ep, e)
        rerun = ("forward", "forward", "backward") if checkpoint == "full" else ("forward", "backward")
        out["ep"] = microbatches * moe_blocks * sum(x[d] for x in exchanges.values() for d in rerun)
    if cp > 1:
        kv = h * shape.get("n_kv_head", shape["n_head"]) // shape["n_head"] // tp  # K or V features of a TP rank
        ring = context.ring_bytes_per_layer(micro_batch, shape["seq_len"], kv, cp, e)
        out["cp"] = microbatches * blocks * (ring["forward"] + ring["backward"])
    return out
