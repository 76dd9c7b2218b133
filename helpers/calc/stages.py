"""What one rank of a layout holds: a GPT's blocks on pipeline stages, split over TP, its experts over EP, its
model states sharded by ZeRO, and the activations of the micro-batches in flight. Pure arithmetic, from the course's
formulas; :mod:`helpers.calc.plan` chooses among layouts with it.

A *shape* is a GPT: vocab, seq_len, n_layer, n_head, d_model, attention (and n_kv_head, moe where they apply). A
*layout* places it on ``dp x cp x tp x pp`` ranks: ``pp`` pipeline stages of equal blocks, or one block fewer on the
first and last (:func:`stage_sizes`), each stage's blocks split over ``tp`` ranks (notebook 09's Megatron plan: the
blocks' six weight matrices, ``12 h^2`` per block, split; the LayerNorms whole; the embeddings and head whole as in the
course's scripts, or split over the vocabulary as Megatron-LM does), and ``dp`` copies of that reading different data
(``cp`` more sharing each sequence, notebook 12), their model states sharded by ZeRO ``stage``. A mixture of experts
(``shape["moe"]``, notebook 13) puts ``E / ep`` of each MoE block's experts on a rank, ``ep`` taken from the dp ranks.
Each step a dp rank runs ``microbatches`` micro-batches of ``micro_batch`` sequences.

Per rank, by stage (:func:`rank_memory`):

    model states   = ZeRO's formula (:func:`helpers.calc.memory.zero_model_state_bytes`) of the stage's parameters
                     on one tp rank (:func:`stage_params`), sharded over dp x cp (the experts over dp x cp / ep)
    activations    = micro-batches in flight x one micro-batch's bytes of the stage's layers, plus the embeddings'
                     token ids on the first stage and the head's logits on the last (:mod:`helpers.calc.activations`)
    in flight      = GPipe: all m (every forward runs before the first backward);
                     1F1B: min(pp - s, m) on stage s (its warm-up forwards), so at most pp on the first stage;
                     interleaved: pp + (pp - 1) / v on the first (:func:`in_flight`)
"""
from __future__ import annotations

from . import activations
from .memory import PRECISIONS, zero_model_state_bytes

SCHEDULES = ("gpipe", "1f1b", "interleaved")
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


def rank_layers(shape: dict, pp: int, stage: int, virtual: int = 1) -> list[int]:
    """The blocks (their indices, from 0) on rank ``stage`` of ``pp``: its stage's, or with ``virtual`` stages per
    rank (the interleaved schedule) those of its chunks ``stage, stage + pp, ...`` of the ``pp x virtual``
    (:func:`stage_sizes`)."""
    sizes = stage_sizes(shape["n_layer"], pp * virtual)
    if sizes is None:
        raise ValueError(f"{shape['n_layer']} layers do not split into {pp * virtual} stages, equal or one layer "
                         f"fewer on the first and the last")
    starts = [sum(sizes[:c]) for c in range(len(sizes))]
    return [i for k in range(virtual) for i in range(starts[stage + k * pp], starts[stage + k * pp] +
                                                     sizes[stage + k * pp])]


def _blocks(shape: dict, pp: int, stage: int, virtual: int = 1) -> int:
    return len(rank_layers(shape, pp, stage, virtual))


def is_moe(shape: dict, layer: int) -> bool:
    """Whether block ``layer`` (from 0) is a mixture of experts: every block after the shape's ``dense_layers``."""
    return "moe" in shape and layer >= shape["moe"].get("dense_layers", 0)


def _split(n: int, tp: int, what: str) -> int:
    if n % tp:
        raise ValueError(f"tp {tp} does not divide {what} ({n} parameters)")
    return n // tp


def block_params(shape: dict, layer: int = 0, tp: int = 1, ep: int = 1) -> dict:
    """Parameters of block ``layer`` on one rank: ``dense`` (held by every data-parallel rank) and ``experts`` (split
    over the ``ep`` expert-parallel ranks). The course GPT's block: attention ``4 h^2`` and MLP ``8 h^2`` split over
    ``tp``, two LayerNorms ``4 h`` whole. With ``shape["moe"]`` = {``experts`` E, ``top_k``, ``ffn`` f, ``shared``,
    ``dense_layers``, ``dense_ffn``, ``matrices`` m (2: the course GPT's GELU MLP; 3: SwiGLU)}, a MoE block's MLP is
    E routed experts of ``m h f`` each, ``E / ep`` of them on a rank, plus ``shared`` experts every token uses and
    the router ``h E`` (whole); the first ``dense_layers`` blocks keep one MLP of ``m h dense_ffn``. Experts are split
    over ``tp`` as the dense MLP is (Megatron-LM's default: expert TP = TP)."""
    h, moe = shape["d_model"], shape.get("moe")
    dense = _split(4 * h * h, tp, f"the attention's matrices (d_model {h})") + 4 * h
    if moe is None:
        return dict(dense=dense + _split(8 * h * h, tp, f"the MLP's matrices (d_model {h})"), experts=0)
    m = moe.get("matrices", 2)
    if not is_moe(shape, layer):
        return dict(dense=dense + _split(m * h * moe["dense_ffn"], tp, "the dense MLP"), experts=0)
    if moe["experts"] % ep:
        raise ValueError(f"{moe['experts']} experts do not split over ep {ep}")
    one = _split(m * h * moe["ffn"], tp, "an expert's matrices")
    return dict(dense=dense + h * moe["experts"] + moe.get("shared", 0) * one, experts=moe["experts"] // ep * one)


def active_params(shape: dict) -> int:
    """Parameters one token uses: every dense parameter, and of each MoE block its ``top_k`` routed experts (the
    FLOPs of a step follow these, not the total)."""
    n = stage_params(shape)
    moe = shape.get("moe")
    if moe is None:
        return n
    one = moe.get("matrices", 2) * shape["d_model"] * moe["ffn"]
    return n - sum((moe["experts"] - moe["top_k"]) * one for i in range(shape["n_layer"]) if is_moe(shape, i))


def bubble(pp: int, microbatches: int, virtual: int = 1) -> float:
    """The idle fraction of a step: ``(p - 1) / (v m + p - 1)``; ``v`` = 1 for GPipe and 1F1B, the stages per rank
    for the interleaved schedule, whose fill and drain take ``1 / v`` of a stage's time per step (Narayanan et al.
    2021, arXiv:2104.04473, Sec. 2.2.2)."""
    return (pp - 1) / (virtual * microbatches + pp - 1)


def stage_params(shape: dict, pp: int = 1, stage: int = 0, tp: int = 1, vocab_parallel: bool = False,
                 virtual: int = 1, ep: int = 1) -> int:
    """Parameters one rank of pipeline stage ``stage`` (of ``pp``) holds at tensor-parallel degree ``tp``: per block
    ``12 h^2 / tp + 4 h`` (the six matrices split, two LayerNorms whole), the embeddings ``(V + s) h`` on the first
    stage, the final LayerNorm ``2 h`` and the untied head ``V h`` on the last. The course's scripts keep the
    embeddings and the head whole on every TP rank; ``vocab_parallel`` splits both over the vocabulary as Megatron-LM
    does (its VocabParallelEmbedding, and the head column-parallel): ``ceil(V / tp) h`` each, the vocabulary padded to
    a multiple of ``tp``; the position embedding stays whole. With ``virtual`` stages per rank (the interleaved
    schedule) rank ``stage`` holds chunks ``stage, stage + pp, ...``: the embeddings on rank 0, the head on the last.
    A mixture of experts (``shape["moe"]``): its blocks as :func:`block_params` counts them, ``E / ep`` experts each.

        >>> stage_params(dict(vocab=10, seq_len=4, n_layer=2, n_head=2, d_model=4))   # helpers.rank.gpt's count
        520
        >>> stage_params(dict(vocab=10, seq_len=4, n_layer=2, n_head=2, d_model=4), pp=2, stage=1, tp=2)
        160
    """
    split = stage_param_split(shape, pp, stage, tp, vocab_parallel, virtual, ep)
    return split["dense"] + split["experts"]


def stage_param_split(shape: dict, pp: int = 1, stage: int = 0, tp: int = 1, vocab_parallel: bool = False,
                      virtual: int = 1, ep: int = 1) -> dict:
    """:func:`stage_params` in two parts: ``dense`` (every data-parallel rank holds them; ZeRO shards them over dp)
    and ``experts`` (the MoE blocks' routed experts, ``E / ep`` per block; their ZeRO group is dp / ep)."""
    h, v = shape["d_model"], shape["vocab"]
    n, routed = 0, 0
    for layer in rank_layers(shape, pp, stage, virtual):
        block = block_params(shape, layer, tp, ep)
        n, routed = n + block["dense"], routed + block["experts"]
    rows = _vocab_rows(v, tp, vocab_parallel)
    if stage == 0:
        n += (rows + shape["seq_len"]) * h
    if stage == pp - 1:
        n += 2 * h + rows * h
    return dict(dense=n, experts=routed)


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
    it, what a flash kernel keeps (:func:`helpers.calc.cp.layer_terms_per_rank`). A mixture of experts' blocks keep
    their MLP's part as :func:`mlp_activation_bytes` counts it."""
    s, b, h = shape["seq_len"] // cp, micro_batch, shape["d_model"]  # a CP rank's positions
    attention = shape.get("attention", "math") if cp == 1 else "sdpa"  # ring attention keeps what flash keeps
    out = 0.0
    for layer in rank_layers(shape, pp, stage, virtual):
        terms = activations.layer_terms(s, b, h, shape["n_head"], dtype, attention, checkpoint, tp, sp)
        if "moe" in shape and checkpoint != "full":
            terms["MLP: GELU input and output"] = mlp_activation_bytes(shape, layer, s * b, dtype, tp, sp)
        out += sum(terms.values())
    head = activations.head_terms(s, b, h, _vocab_rows(shape["vocab"], tp, vocab_parallel), dtype)
    ids = activations.INDEX_BYTES * s * b  # the token ids (first stage) or the targets (last)
    if stage == 0:
        out += ids + activations.INDEX_BYTES * s  # and the positions
    if stage == pp - 1:
        out += head["final LayerNorm input and output"] + head["logits and log_softmax"] + ids
    return out


def mlp_activation_bytes(shape: dict, layer: int, tokens: int, dtype: str = "bf16", tp: int = 1,
                         sp: bool = False) -> float:
    """Bytes the MLP of block ``layer`` of a ``shape["moe"]`` model keeps for backward on one rank, for ``tokens``
    tokens (its input, the LayerNorm's output, is counted with the LayerNorm): a dense block's hidden activations,
    ``m' f`` per token (``m'`` = 2 for the GELU MLP, its input and output; 4 for SwiGLU, gate, up, their activation
    and product); a MoE block's for each of its ``top_k`` routed and ``shared`` experts, plus the token's ``top_k``
    rows as the experts received them and as they returned (the combine's weights need both), and the router's fp32
    probabilities (``E`` per token, softmax's output), its top-k's int64 indices and the ``k`` gate weights. Expert
    parallelism moves rows but does not change how many a rank keeps, under balanced routing; TP splits ``f``, and
    with sequence parallelism a rank routes ``1 / tp`` of the tokens.

        >>> mlp_activation_bytes(dict(d_model=4, moe=dict(experts=2, top_k=1, ffn=16, dense_layers=1, dense_ffn=16)),
        ...                      0, tokens=1, dtype="fp32")     # the course GPT's 8 s b h at f = 4 h
        128.0
    """
    moe, h, e = shape["moe"], shape["d_model"], activations.DTYPE_BYTES[dtype]
    hidden = 2 if moe.get("matrices", 2) == 2 else 4
    whole = tp if sp else 1
    if not is_moe(shape, layer):
        return e * tokens * hidden * moe["dense_ffn"] / tp
    k, used = moe["top_k"], moe["top_k"] + moe.get("shared", 0)
    router = 4 * moe["experts"] + k * (activations.INDEX_BYTES + e)
    return e * tokens * (used * hidden * moe["ffn"] / tp + 2 * k * h / whole) + tokens * router / whole


def split_state_bytes(split: dict, replicas: int, ep: int, zero: int, precision: str) -> dict:
    """ZeRO's model-state bytes of :func:`stage_param_split`'s ``split``: the dense parameters sharded over the
    ``replicas`` ranks that hold them, the routed experts over the ``replicas / ep`` that hold the same ones."""
    states = zero_model_state_bytes(split["dense"], replicas, zero, precision)
    if split["experts"]:
        routed = zero_model_state_bytes(split["experts"], replicas // ep, zero, precision)
        states = {k: states[k] + routed[k] for k in states}
    return states


def rank_memory(shape: dict, *, dp: int = 1, tp: int = 1, pp: int = 1, zero: int = 0, checkpoint: str = "none",
                micro_batch: int = 1, microbatches: int = 1, schedule: str = "1f1b", precision: str = "fp32",
                sp: bool = False, step_counters: bool = False, vocab_parallel: bool = False, cp: int = 1,
                virtual: int = 1, ep: int = 1) -> list[dict]:
    """Per pipeline stage, what one rank holds at its peak: ``params`` (count), the model states ``params_bytes``,
    ``grads``, ``optimizer``, ``in_flight`` micro-batches, ``activations`` and ``total`` (bytes). ``step_counters``:
    add AdamW's fp32 step counter per parameter tensor (:data:`ADAM_STEP_BYTES`, with ``tensors`` per stage
    from :func:`stage_tensors`), to compare with what torch's optimizer measurably keeps. ``vocab_parallel``: the
    embeddings and head split over TP as Megatron-LM does (:func:`stage_params`). ``cp``: context-parallel ranks,
    which hold the same weights as DP ranks do (their gradients are reduced over ``dp x cp``, and ZeRO shards over
    ``dp x cp``, as torchtitan's FSDP does) and each a ``1 / cp`` share of every sequence's activations.
    ``virtual``: chunks per rank of the interleaved schedule (a "stage" is then a rank, its chunks together).
    ``ep``: expert-parallel ranks, taken from the ``dp x cp`` ranks (torchtitan and DeepSeek-V3 do so): each holds
    ``E / ep`` of a MoE block's experts, whose ZeRO group is the ``dp x cp / ep`` ranks that hold the same ones."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if (dp * cp) % ep:
        raise ValueError(f"ep {ep} does not divide the dp x cp = {dp * cp} ranks it is taken from")
    out = []
    for stage in range(pp):
        split = stage_param_split(shape, pp, stage, tp, vocab_parallel, virtual, ep)
        n = split["dense"] + split["experts"]
        states = split_state_bytes(split, dp * cp, ep, zero, precision)
        optimizer = states["optimizer"] + (ADAM_STEP_BYTES * stage_tensors(shape, pp, stage, virtual)
                                           if step_counters else 0)
        held = in_flight(schedule, pp, stage, microbatches, virtual)
        act = held * microbatch_activation_bytes(shape, micro_batch, pp, stage, tp, sp, _dtype(precision), checkpoint,
                                                 vocab_parallel, cp, virtual)
        out.append(dict(stage=stage, params=n, experts=split["experts"], params_bytes=states["params"],
                        grads=states["grads"],
                        optimizer=optimizer, in_flight=held, activations=act,
                        total=states["params"] + states["grads"] + optimizer + act))
    return out


def stage_tensors(shape: dict, pp: int = 1, stage: int = 0, virtual: int = 1) -> int:
    """Parameter tensors of a stage: 10 per block (six matrices, two LayerNorms' weight and bias), 2 embeddings
    on the first stage, the final LayerNorm's two and the head on the last. (A MoE block's experts are counted as
    its MLP's two matrices, as grouped experts stored in one tensor per matrix are.)"""
    n = 10 * _blocks(shape, pp, stage, virtual)
    return n + (2 if stage == 0 else 0) + (3 if stage == pp - 1 else 0)
