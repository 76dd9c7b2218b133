"""Real models' shapes for the course GPT, and what one rank of a layout should hold by the course's formulas. Pure
arithmetic (course/gpt_at_scale.py measures the same rank on fake tensors and a fake process group).

The course GPT (helpers.rank.gpt) is GPT-2's block: multi-head attention (q, k, v, proj: 4 h^2) and a 4h GELU MLP
(8 h^2). GPT-3 175B has exactly that block. The Llama 3 models use grouped-query attention and a SwiGLU MLP, so the
course GPT at their width, depth, heads and vocabulary is not their parameter count: :data:`MODELS` gives each
published shape and :func:`course_params` what the course GPT holds at it: 12 h^2 per block, where Llama 3 8B's
block (grouped-query attention 2.5 h^2, SwiGLU MLP 10.5 h^2) holds 13 h^2.

Published hyperparameters:
- GPT-3 175B: 96 layers, d 12288, 96 heads, context 2048 (Brown et al. 2020, arXiv:2005.14165, Table 2.1); GPT-2's
  byte-pair vocabulary of 50257 tokens.
- Llama 3 8B / 70B / 405B: 32 / 80 / 126 layers, d 4096 / 8192 / 16384, 32 / 64 / 128 heads (Llama Team 2024,
  arXiv:2407.21783, Table 3, which rounds the vocabulary to 128,000; the released tokenizer has 128,256), sequence
  8192 in pre-training. Llama 3 rotates positions (RoPE) where the course GPT learns a position embedding: s h more
  parameters on the first stage (134 M at 405B's width and 8192 tokens).
"""
from __future__ import annotations

from . import activations
from .flags import divisors
from .memory import zero_model_state_bytes
from .stages import microbatch_activation_bytes, stage_params, stage_sizes

MODELS = {
    "gpt3-175b": dict(vocab=50257, seq_len=2048, n_layer=96, n_head=96, d_model=12288, attention="sdpa"),
    "llama3-8b": dict(vocab=128256, seq_len=8192, n_layer=32, n_head=32, d_model=4096, attention="sdpa"),
    "llama3-70b": dict(vocab=128256, seq_len=8192, n_layer=80, n_head=64, d_model=8192, attention="sdpa"),
    "llama3-405b": dict(vocab=128256, seq_len=8192, n_layer=126, n_head=128, d_model=16384, attention="sdpa"),
}


def course_params(shape: dict) -> int:
    """Parameters of the course GPT at ``shape`` (all stages, no parallelism)."""
    return stage_params(shape, 1, 0, 1)


def layout_problem(shape: dict, world: int, tp: int, pp: int, stage: int) -> str | None:
    """What makes a layout impossible before anything is built, with what would work; None when it is possible."""
    for name, value in (("--world", world), ("--tp", tp), ("--pp", pp)):
        if value < 1:
            return f"{name} {value}: a degree is a whole number of ranks, 1 or more"
    if world % (tp * pp):
        return f"--tp {tp} x --pp {pp} = {tp * pp} does not divide --world {world}: dp would not be whole"
    if shape["n_head"] % tp:
        return f"--tp {tp} does not divide the {shape['n_head']} heads; use one of {divisors(shape['n_head'])}"
    if shape["seq_len"] % tp:
        return f"--tp {tp} does not divide the sequence of {shape['seq_len']} (sequence parallelism cuts it)"
    if pp > shape["n_layer"]:
        return f"--pp {pp} is more stages than the {shape['n_layer']} layers"
    if stage_blocks(shape, pp, 0) is None:
        near = sorted(p for p in range(1, shape["n_layer"] + 1) if stage_blocks(shape, p, 0) is not None)
        return (f"--pp {pp} does not split the {shape['n_layer']} layers into equal stages (nor equal but the first "
                f"and last, one layer fewer each); use one of {', '.join(map(str, near[:12]))}")
    if not 0 <= stage < pp:
        return f"--stage {stage} is not one of the {pp} stages 0..{pp - 1}"
    return None


def stage_blocks(shape: dict, pp: int, stage: int) -> int | None:
    """Blocks on pipeline stage ``stage`` of ``pp`` (:func:`helpers.calc.plan.stage_sizes`: equal stages, or one layer
    fewer on the first and last, as Llama 3 405B's 126 layers on 16 stages). None: neither split exists."""
    sizes = stage_sizes(shape["n_layer"], pp)
    return None if sizes is None else sizes[stage]


def expected(shape: dict, *, world: int, tp: int, pp: int, stage: int, micro_batch: int = 1) -> dict:
    """One rank's bytes by the formulas, for FSDP2 (ZeRO-3) over ``dp = world / (tp pp)`` with fp32 sharded
    parameters, bf16 compute and TP with torch's sequence parallelism: ``params``, ``grads`` and ``optimizer``
    (ZeRO-3's 4 + 4 + 8 bytes per parameter, over dp; notebook 03) and ``activations`` after one micro-batch's forward
    (notebook 08's terms in bf16, split by TP and SP as notebook 09 measured them, the all-gathered LayerNorm outputs
    kept whole)."""
    dp = world // (tp * pp)
    blocks = stage_blocks(shape, pp, stage)
    even = dict(shape, n_layer=blocks * pp)  # the formulas split the layers equally: this stage's count on every stage
    n = stage_params(even, pp, stage, tp)
    states = zero_model_state_bytes(n, dp, 3, "fp32")
    s, b, h, a = shape["seq_len"], micro_batch, shape["d_model"], shape["n_head"]
    sp = tp > 1
    args = (s, b, h, a, "bf16", shape.get("attention", "sdpa"), "none", tp, sp)
    whole = activations.layer_bytes(*args, gathered_whole=sp) - activations.layer_bytes(*args)  # torch's SP plan
    act = microbatch_activation_bytes(even, micro_batch, pp, stage, tp, sp, "bf16") + blocks * whole
    return dict(dp=dp, params_count=n, params=states["params"], grads=states["grads"],
                optimizer=states["optimizer"], blocks=blocks, activations=act)
