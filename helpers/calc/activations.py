"""Activation memory of a transformer: Korthikanti et al.'s formula, and the same count for the course's GPT.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models" (arXiv:2205.05198, Sec. 4,
eq. 1; the Ultra-Scale Playbook uses it) count the bytes one transformer layer keeps for backward, in fp16 with
dropout, for sequence length s, micro batch b, width h and a heads:

    34 s b h + 5 a s^2 b  bytes      = 2 bytes x (16 s b h + 2 a s^2 b)  +  dropout masks (2 s b h + a s^2 b, 1 byte)

The course's GPT (:mod:`helpers.rank.gpt`) has no dropout, so the masks go and the softmax output is saved once
(no dropout output beside it): in elements, per layer

    LN1 input 1 + LN1 output 1 + q, k, v 3 + attention output 1 + LN2 input 1 + LN2 output 1 + GELU in 4 + out 4
    = 16 s b h,  plus the softmax output a s^2 b ("math" attention)  or its logsumexp a s b ("sdpa": flash)

times the bytes of the dtype (4 in fp32, 2 in bf16; logsumexp stays fp32). Small named terms: LayerNorm's mean
and 1/std (2 b s per LayerNorm) and the causal mask (s^2 bools, "math" only). Outside the layers: the final
LayerNorm's input and output (2 s b h), the logits and log_softmax's output (s b V each), the token ids and targets
(int64). Checkpointing: "selective" recomputes the attention core, so the s^2 term (and the mask) goes; "full"
keeps only each block's input, s b h per layer.

Tensor parallelism over t ranks without sequence parallelism (Korthikanti eq. 2): the LayerNorms' inputs and
outputs stay whole on every rank, the rest of the layer divides by t; with sequence parallelism (eq. 4) everything
divides by t.

Pure arithmetic (no torch). Example::

    layer_bytes(s=64, b=8, h=64, a=4) / (64 * 8 * 64 * 4)   # 20.1: 16 sbh + a s/h = 4 sbh of softmax, in fp32
    korthikanti_layer_bytes(2048, 1, 12288, 96) / 2**30     # 2.67 (GiB; GPT-3 175B, one layer, micro batch 1)
"""
from __future__ import annotations

DTYPE_BYTES = {"fp64": 8, "fp32": 4, "bf16": 2, "fp16": 2}
INDEX_BYTES = 8  # int64 token ids and targets
CHECKPOINTS = ("none", "selective", "full")
ATTENTIONS = ("math", "sdpa")


def _check(dtype: str, attention: str, checkpoint: str, tp: int) -> int:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
    if checkpoint not in CHECKPOINTS:
        raise ValueError(f"checkpoint must be one of {CHECKPOINTS}, got {checkpoint!r}")
    if tp < 1:
        raise ValueError(f"tp must be at least 1, got {tp}")
    return DTYPE_BYTES[dtype]


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, tp: int = 1, sp: bool = False,
                            selective: bool = False) -> float:
    """One layer's activation bytes by the paper (fp16, dropout): eq. 1 (``tp=1``), eq. 2 (tensor parallel),
    eq. 4 (``sp=True``); ``selective``: the 5 a s^2 b term recomputed (Sec. 5).

    Example::

        korthikanti_layer_bytes(2048, 1, 12288, 96, tp=8, sp=True, selective=True)  # 34 sbh / 8
    """
    attn = 0 if selective else 5 * a * s / h
    if sp:
        return s * b * h * (34 + attn) / tp
    return s * b * h * (10 + (24 + attn) / tp)


def layer_terms(s: int, b: int, h: int, a: int, dtype: str = "fp32", attention: str = "math",
                checkpoint: str = "none", tp: int = 1, sp: bool = False, gathered_whole: bool = False) -> dict:
    """Bytes one GPT layer keeps for backward, by named term, as :mod:`helpers.rank.gpt` saves them.

    ``gathered_whole`` (with ``sp``): the all-gathered LayerNorm outputs that attention's q/k/v and the MLP's up
    projection read are kept whole for their backward, as torch's ``SequenceParallel`` plan does (2 s b h per rank,
    whatever ``tp``). Megatron-LM keeps only this rank's 1/t of each and all-gathers it again in the backward
    (Korthikanti et al. Sec. 4.2.3), which is the default here and eq. 4's count.

    Example::

        layer_terms(64, 8, 64, 4)["softmax output"]   # 4 * 64 * 64 * 8 * 4 bytes: a s^2 b fp32 elements
    """
    e = _check(dtype, attention, checkpoint, tp)
    sbh = s * b * h
    split = tp  # what tensor parallelism divides
    whole = tp if sp else 1  # the LayerNorm region: whole on every rank unless sequence-parallel
    if checkpoint == "full":
        return {"block input": e * sbh / whole}
    if sp and gathered_whole:
        ln = {"LayerNorm inputs": 2 * e * sbh / whole, "all-gathered LayerNorm outputs": 2 * e * sbh}
    else:
        ln = {"LayerNorm inputs and outputs": 4 * e * sbh / whole}
    terms = {**ln,
             "LayerNorm mean and 1/std": 4 * e * b * s / whole,
             "q, k, v": 3 * e * sbh / split,
             "attention output": e * sbh / split,
             "MLP: GELU input and output": 8 * e * sbh / split}
    if checkpoint == "none":
        if attention == "math":
            terms["softmax output"] = e * a * s * s * b / split
            terms["causal mask"] = s * s  # one bool per (query, key) pair, shared by the heads
        else:
            terms["logsumexp"] = max(e, 4) * a * s * b / split  # the flash kernel keeps it in fp32 (or fp64)
    return terms


def layer_bytes(s: int, b: int, h: int, a: int, dtype: str = "fp32", attention: str = "math",
                checkpoint: str = "none", tp: int = 1, sp: bool = False, gathered_whole: bool = False) -> float:
    """The sum of :func:`layer_terms`: one layer's activation bytes per rank."""
    return sum(layer_terms(s, b, h, a, dtype, attention, checkpoint, tp, sp, gathered_whole).values())


def head_terms(s: int, b: int, h: int, vocab: int, dtype: str = "fp32") -> dict:
    """Bytes kept outside the layers: the final LayerNorm, the logits (the forward returns them) and
    log_softmax's output inside the cross-entropy, and the int64 token ids and targets. The GPT computes its loss
    in fp32 at least (bf16 logits are widened first, as Megatron-LM's cross-entropy does), so log_softmax's output
    is 4 bytes an element in bf16 too."""
    e = DTYPE_BYTES[dtype]
    return {"final LayerNorm input and output": 2 * e * s * b * h + 2 * e * b * s,
            "logits and log_softmax": (e + max(e, 4)) * s * b * vocab,
            "token ids and targets": 2 * INDEX_BYTES * s * b + INDEX_BYTES * s}


def model_terms(s: int, b: int, h: int, a: int, n_layer: int, vocab: int, dtype: str = "fp32",
                attention: str = "math", checkpoint: str = "none", tp: int = 1, sp: bool = False) -> dict:
    """The whole model's activation bytes at the end of forward: ``layers`` (n_layer x :func:`layer_bytes`),
    ``head`` (:func:`head_terms`, not split by ``tp``) and ``total``."""
    layers = n_layer * layer_bytes(s, b, h, a, dtype, attention, checkpoint, tp, sp)
    head = sum(head_terms(s, b, h, vocab, dtype).values())
    return {"layers": layers, "head": head, "total": layers + head}


def model_bytes(s: int, b: int, h: int, a: int, n_layer: int, vocab: int, dtype: str = "fp32",
                attention: str = "math", checkpoint: str = "none", tp: int = 1, sp: bool = False) -> float:
    """``model_terms(...)["total"]``: what a rank holds in activations when its forward has just finished.

    Example::

        model_bytes(64, 8, 64, 4, n_layer=1, vocab=64) / (64 * 8 * 64 * 4)   # 24.2 s b h fp32 elements
    """
    return model_terms(s, b, h, a, n_layer, vocab, dtype, attention, checkpoint, tp, sp)["total"]


def checkpoint_saving(s: int, b: int, h: int, a: int, n_layer: int, vocab: int, dtype: str = "fp32",
                      attention: str = "math") -> dict:
    """Activation bytes saved by each checkpointing mode against none, by the formula (fraction of none's)."""
    none = model_bytes(s, b, h, a, n_layer, vocab, dtype, attention, "none")
    return {mode: 1 - model_bytes(s, b, h, a, n_layer, vocab, dtype, attention, mode) / none
            for mode in CHECKPOINTS}


def tp_local_params(params: float, gpt: dict, tp: int = 1) -> float:
    """Parameters one tensor-parallel rank holds under notebook 09's plan: the blocks' q, k, v, proj, up and down
    matrices (``12 h^2`` per layer) split ``tp`` ways; the token and position embeddings, the untied head and the
    LayerNorms whole on every rank.

        >>> tp_local_params(1000, dict(d_model=4, n_layer=2), tp=1)
        1000
        >>> tp_local_params(1000, dict(d_model=4, n_layer=2), tp=4)   # 2 x 12 x 16 = 384 split, 616 whole
        712.0
    """
    split = 12 * gpt["d_model"] ** 2 * gpt["n_layer"]
    return params if tp == 1 else params - split + split / tp


def step_memory_bytes(params: float, dp: int, stage: int, precision: str, *, gpt: dict, checkpoint: str = "none",
                      tp: int = 1, sp: bool = False) -> dict:
    """Bytes per device of one training step: the ZeRO model states of the parameters a tensor-parallel rank holds
    (:func:`tp_local_params`: notebook 09's plan splits the blocks' weight matrices and keeps the embeddings, the head
    and the LayerNorms whole) over ``dp`` data-parallel ranks (:func:`helpers.calc.memory.zero_model_state_bytes`),
    plus the activations of ``gpt`` (seq_len, batch, d_model, n_head, n_layer, vocab, attention, dtype) by
    :func:`model_terms`. Keys: the model states' and ``activations`` (a :func:`model_terms` dict), ``total``.

    Example::

        step_memory_bytes(1e6, 2, 0, "fp32", gpt=dict(seq_len=64, batch=8, d_model=64, n_head=4, n_layer=2,
                          vocab=64, attention="math", dtype="fp32"))["total"]
    """
    from .memory import zero_model_state_bytes

    g = gpt
    out = dict(zero_model_state_bytes(tp_local_params(params, g, tp), dp, stage, precision))
    out["activations"] = model_terms(g["seq_len"], g["batch"], g["d_model"], g["n_head"], g["n_layer"], g["vocab"],
                                     g.get("dtype", "fp32"), g.get("attention", "math"), checkpoint, tp, sp)
    out["total"] = out["total"] + out["activations"]["total"]
    return out
