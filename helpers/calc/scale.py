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
- DeepSeek-V3, as the course GPT can be shaped to it (DeepSeek-AI 2024, arXiv:2412.19437, Sec. 4.2): 61 layers of
  d 7168 and 128 heads, the first 3 dense (SwiGLU, FFN 18432), the others a MoE of 1 shared and 256 routed experts of
  FFN 2048, top-8; vocabulary 129280; 4096 tokens. Its multi-token-prediction module's block is a 62nd layer (its
  embedding and head are the model's). The course GPT's attention is MHA (4 h^2, 205 M a layer) where DeepSeek-V3's
  is multi-head latent attention (187 M).
"""
from __future__ import annotations

from . import activations
from .cp import ring_bytes_per_layer
from .flags import divisors
from .plan import H100_NODE, mfu, propose, step_comm_bytes
from .stages import (microbatch_activation_bytes, split_state_bytes, stage_param_split, stage_params,
                     stage_sizes)

MODELS = {
    "gpt3-175b": dict(vocab=50257, seq_len=2048, n_layer=96, n_head=96, d_model=12288, attention="sdpa"),
    "llama3-8b": dict(vocab=128256, seq_len=8192, n_layer=32, n_head=32, d_model=4096, attention="sdpa"),
    "llama3-70b": dict(vocab=128256, seq_len=8192, n_layer=80, n_head=64, d_model=8192, attention="sdpa"),
    "llama3-405b": dict(vocab=128256, seq_len=8192, n_layer=126, n_head=128, d_model=16384, attention="sdpa"),
    "deepseek-v3": dict(vocab=129280, seq_len=4096, n_layer=62, n_head=128, d_model=7168, attention="sdpa",
                        moe=dict(experts=256, top_k=8, ffn=2048, shared=1, dense_layers=3, dense_ffn=18432,
                                 matrices=3)),
}
DEEPSEEK_V3 = MODELS["deepseek-v3"]


def course_params(shape: dict) -> int:
    """Parameters of the course GPT at ``shape`` (all stages, no parallelism)."""
    return stage_params(shape, 1, 0, 1)


def layout_problem(shape: dict, world: int, tp: int, pp: int, stage: int, ep: int = 1, cp: int = 1) -> str | None:
    """What makes a layout impossible before anything is built, with what would work; None when it is possible."""
    for name, value in (("--world", world), ("--tp", tp), ("--pp", pp), ("--ep", ep), ("--cp", cp)):
        if value < 1:
            return f"{name} {value}: a degree is a whole number of ranks, 1 or more"
    if world % (tp * pp * cp):
        degrees = f"--tp {tp} x --pp {pp}" + (f" x --cp {cp}" if cp > 1 else "")
        return f"{degrees} = {tp * pp * cp} does not divide --world {world}: dp would not be whole"
    if shape["n_head"] % tp:
        return f"--tp {tp} does not divide the {shape['n_head']} heads; use one of {divisors(shape['n_head'])}"
    if shape["seq_len"] % tp:
        return f"--tp {tp} does not divide the sequence of {shape['seq_len']} (sequence parallelism cuts it)"
    if cp > 1 and shape["seq_len"] % (2 * cp * tp):
        return (f"--cp {cp}: the zig-zag layout cuts the sequence into 2 x cp = {2 * cp} chunks and sequence "
                f"parallelism a rank's share into --tp {tp}: {shape['seq_len']} tokens do not split into "
                f"{2 * cp * tp}; use a sequence length that is a multiple of {2 * cp * tp}")
    if cp > 1 and "moe" in shape:
        return f"--cp {cp}: the simulation runs context parallelism for dense models only; use --cp 1 with experts"
    if pp > shape["n_layer"]:
        return f"--pp {pp} is more stages than the {shape['n_layer']} layers"
    if stage_blocks(shape, pp, 0) is None:
        near = sorted(p for p in range(1, shape["n_layer"] + 1) if stage_blocks(shape, p, 0) is not None)
        return (f"--pp {pp} does not split the {shape['n_layer']} layers into equal stages (nor equal but the first "
                f"and last, one layer fewer each); use one of {', '.join(map(str, near[:12]))}")
    if not 0 <= stage < pp:
        return f"--stage {stage} is not one of the {pp} stages 0..{pp - 1}"
    return _ep_problem(shape, world // (tp * pp * cp), tp, ep)


def _ep_problem(shape: dict, dp: int, tp: int, ep: int) -> str | None:
    moe = shape.get("moe")
    if moe is None:
        return None if ep == 1 else f"--ep {ep}: this model has no experts to spread; use --ep 1"
    if tp > 1:
        return f"--tp {tp}: the simulation spreads a mixture of experts over EP, not TP; use --tp 1"
    if dp % ep:
        return f"--ep {ep} does not divide the {dp} data-parallel ranks it is taken from; use one of {divisors(dp)}"
    if moe["experts"] % ep:
        return (f"--ep {ep} does not split the {moe['experts']} experts; use one of "
                f"{divisors(dp, lambda d: moe['experts'] % d == 0)}")
    return None


def stage_blocks(shape: dict, pp: int, stage: int) -> int | None:
    """Blocks on pipeline stage ``stage`` of ``pp`` (:func:`helpers.calc.plan.stage_sizes`: equal stages, or one layer
    fewer on the first and last, as Llama 3 405B's 126 layers on 16 stages). None: neither split exists."""
    sizes = stage_sizes(shape["n_layer"], pp)
    return None if sizes is None else sizes[stage]


def expected(shape: dict, *, world: int, tp: int, pp: int, stage: int, micro_batch: int = 1, ep: int = 1,
             checkpoint: str = "none", cp: int = 1) -> dict:
    """One rank's bytes by the formulas, for FSDP2 (ZeRO-3) over ``dp = world / (tp pp cp)`` and the CP ranks (they
    hold the same weights) with fp32 sharded parameters, bf16 compute and TP with torch's sequence parallelism:
    ``params``, ``grads`` and ``optimizer`` (ZeRO-3's 4 + 4 + 8 bytes per parameter, over dp x cp; notebook 03) and
    ``activations`` after one micro-batch's forward (notebook 08's terms in bf16, split by TP and SP as notebook 09
    measured them, the all-gathered LayerNorm outputs kept whole; with ``checkpoint="full"`` only each block's input;
    with CP at ``s / cp`` positions, attention kept as ring attention keeps it, notebook 12), and on every stage but
    the last the output it sends on (kept until its gradient comes back). A mixture of experts: E / ep experts per
    block, sharded over the dp / ep ranks that hold the same ones, the MoE activations of
    :func:`helpers.calc.stages.mlp_activation_bytes`, and the bytes its all-to-alls send in the step
    (:func:`helpers.calc.plan.step_comm_bytes`'s ``ep``, for this stage's MoE blocks). With CP, ``ring bytes sent``:
    :func:`helpers.calc.cp.ring_bytes_per_layer` for this rank's heads, each block's forward ring run twice with
    recomputation."""
    dp = world // (tp * pp * cp)
    blocks = stage_blocks(shape, pp, stage)
    split = stage_param_split(shape, pp, stage, tp, ep=ep)
    n = split["dense"] + split["experts"]
    states = split_state_bytes(split, dp * cp, ep, 3, "fp32")
    s, b, h, a = shape["seq_len"] // cp, micro_batch, shape["d_model"], shape["n_head"]  # this rank's positions
    sp = tp > 1
    args = (s, b, h, a, "bf16", shape.get("attention", "sdpa"), checkpoint, tp, sp)
    whole = activations.layer_bytes(*args, gathered_whole=sp) - activations.layer_bytes(*args)  # torch's SP plan
    act = (microbatch_activation_bytes(shape, micro_batch, pp, stage, tp, sp, "bf16", checkpoint, cp=cp)
           + blocks * whole)
    if stage < pp - 1:  # the output sent on, kept for the backward that its gradient starts
        act += activations.DTYPE_BYTES["bf16"] * s * b * h / tp
    sent = step_comm_bytes(shape, dp=dp, tp=tp, pp=pp, micro_batch=micro_batch, precision="mixed", ep=ep,
                           stage=stage, checkpoint=checkpoint).get("ep", 0.0) if ep > 1 else 0.0
    ring = ring_bytes_per_layer(b, shape["seq_len"], h // tp, cp, activations.DTYPE_BYTES["bf16"])
    ring_sent = blocks * (ring["forward"] * (2 if checkpoint == "full" else 1) + ring["backward"])
    return dict(dp=dp, params_count=n, params=states["params"], grads=states["grads"],
                optimizer=states["optimizer"], blocks=blocks, activations=act, **{"all-to-all bytes sent": sent},
                **{"ring bytes sent": ring_sent})


# ------------------------------------------------------------------------------------- published layouts, planned

# Machines as their authors give them. H100 DGX: helpers.calc.plan.H100_NODE. H800: the H100's compute, NVLink
# 160 GB/s, InfiniBand 50 GB/s a GPU (DeepSeek-AI 2024, arXiv:2412.19437, Sec. 3.2.2). A100 DGX: 312 TFLOP/s dense
# bf16, NVLink 3 at 300 GB/s each way, 8 HDR InfiniBand ports of 200 Gb/s a node, 25 GB/s a GPU (Narayanan et al.
# 2021, Sec. 5).
H800_NODE = dict(H100_NODE, nvlink=160e9, network=50e9)
A100_NODE = dict(H100_NODE, flops=312e12, nvlink=300e9, network=25e9)

LLAMA3_405B_GQA = dict(MODELS["llama3-405b"], n_kv_head=8)  # 8 K/V heads: ring attention's blocks (planner only)
PUBLISHED = (
    dict(name="Llama 3 405B, 8K tokens", shape=LLAMA3_405B_GQA, gpus=16384, hardware=H100_NODE, global_batch=2048,
         layout=dict(dp=128, cp=1, tp=8, pp=16), reported_mfu=(0.38, 0.43),
         source="Llama Team 2024, arXiv:2407.21783, Table 4 (16M tokens a step)"),
    dict(name="Llama 3 405B, 128K tokens", shape=dict(LLAMA3_405B_GQA, seq_len=131072), gpus=16384,
         hardware=H100_NODE, global_batch=128, layout=dict(dp=8, cp=16, tp=8, pp=16), reported_mfu=(0.38, 0.38),
         source="Balaji, SC'24 (Llama 3's hyperparameters; 16M tokens a step)"),
    dict(name="DeepSeek-V3", shape=DEEPSEEK_V3, gpus=2048, hardware=H800_NODE, global_batch=15360,
         layout=dict(dp=128, cp=1, tp=1, pp=16, ep=64, zero=1), reported_mfu=None,
         source="DeepSeek-AI 2024, arXiv:2412.19437, Sec. 3.2 and 4.2"),
    dict(name="GPT-3 175B, Megatron-LM", shape=MODELS["gpt3-175b"], gpus=1536, hardware=A100_NODE,
         global_batch=1536, layout=dict(dp=16, cp=1, tp=8, pp=12), reported_mfu=(0.39, 0.39),
         source="Narayanan et al. 2021, arXiv:2104.04473, Table 1 (52% of peak counting recomputation: 39% MFU)"),
)


def planned(entry: dict, gpu_bytes: float = 80e9, gpus_per_node: int = 8) -> dict:
    """Where :func:`helpers.calc.plan.propose` places a published layout (``entry`` of :data:`PUBLISHED`): ``fits``
    (the layouts that fit, fastest first), ``theirs`` (the best-placed of those that match the authors' degrees, any
    ZeRO stage, schedule or recomputation they did not state, or None when none fits), ``rank`` (its place, from 1),
    ``mfu`` (the model's, for theirs and for the first) and ``first`` (the planner's choice). Stated, not tuned: the
    planner knows nothing of the entry but its shape, machine and batch."""
    shape = entry["shape"]
    cps = tuple(sorted({1, entry["layout"].get("cp", 1)}))
    fits = propose(shape, gpu_bytes=gpu_bytes, n_gpus=entry["gpus"], gpus_per_node=gpus_per_node,
                   global_batch=entry["global_batch"], hardware=entry["hardware"], cps=cps,
                   schedules=("1f1b", "interleaved"))
    match = [i for i, f in enumerate(fits) if all(f["layout"].get(k, 1) == v for k, v in entry["layout"].items())]
    theirs = fits[match[0]] if match else None

    def mfu_of(f):
        return None if f is None else mfu(shape, f["layout"], f["seconds"]["total"],
                                          global_batch=entry["global_batch"], hardware=entry["hardware"])

    return dict(fits=fits, theirs=theirs, rank=match[0] + 1 if match else None, mfu=mfu_of(theirs),
                first=fits[0] if fits else None, first_mfu=mfu_of(fits[0] if fits else None))
