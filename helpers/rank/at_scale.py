"""The model course/gpt_at_scale.py simulates: the course GPT's layers of one pipeline stage at a published shape,
split as the course's scripts split them (TP + SP, FSDP2), and for a mixture of experts a MoE layer whose experts
are spread over EP ranks.

Under FakeTensorMode a router's choice cannot be read (every value is fake), so :class:`BalancedMoE` routes each
token to ``k`` experts by construction, the same number of rows to every expert: the balanced routing that
:func:`helpers.calc.moe.uniform_bytes_per_layer` assumes and a load-balancing loss aims at. It runs what a real MoE
layer runs on those rows (router, softmax, top-k gates, dispatch all-to-all, the local experts as one batched matmul,
combine all-to-all, gate-weighted sum, shared experts), so memory and traffic are those of routed tokens; only which
expert a token reaches is not the router's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.utils.checkpoint import checkpoint
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from .cp import layout_indices, ring_attention
from .gpt import GPT, GPTConfig
from .moe import all_to_all_rows
from .pipeline import Stage


def _activation(z: torch.Tensor, glu: bool) -> torch.Tensor:
    """GELU (the course GPT's MLP), or SwiGLU on ``z``'s two halves (gate, up)."""
    if not glu:
        return F.gelu(z)
    gate, up = z.chunk(2, dim=-1)
    return F.silu(gate) * up


class FeedForward(nn.Module):
    """A dense MLP of hidden width ``ffn``: GELU with 2 matrices, or SwiGLU with 3 (gate and up stored as one)."""

    def __init__(self, d_model: int, ffn: int, glu: bool):
        super().__init__()
        self.glu = glu
        self.up = nn.Linear(d_model, (2 if glu else 1) * ffn, bias=False)
        self.down = nn.Linear(ffn, d_model, bias=False)

    def forward(self, x):
        return self.down(_activation(self.up(x), self.glu))


class GroupedExperts(nn.Module):
    """This rank's ``local`` experts as two stacked weights, run as batched matmuls on rows grouped by expert."""

    def __init__(self, local: int, d_model: int, ffn: int, glu: bool):
        super().__init__()
        self.glu = glu
        self.w_in = nn.Parameter(torch.empty(local, d_model, (2 if glu else 1) * ffn))
        self.w_out = nn.Parameter(torch.empty(local, ffn, d_model))

    def forward(self, rows):  # (local, rows per expert, d_model)
        return torch.bmm(_activation(torch.bmm(rows, self.w_in), self.glu), self.w_out)


class BalancedMoE(nn.Module):
    """A MoE layer of ``experts`` (``experts / ep`` here), top-``top_k``, plus ``shared`` experts every token uses,
    over the EP process group ``group``, routing every expert the same number of rows (the module docstring)."""

    def __init__(self, d_model: int, moe: dict, group, ep: int):
        super().__init__()
        experts, glu = moe["experts"], moe.get("matrices", 2) == 3
        self.top_k, self.ep, self.local, self.group = moe["top_k"], ep, experts // ep, group
        self.router = nn.Linear(d_model, experts, bias=False)
        self.experts = GroupedExperts(self.local, d_model, moe["ffn"], glu)
        shared = moe.get("shared", 0)
        self.shared = FeedForward(d_model, shared * moe["ffn"], glu) if shared else None

    def forward(self, x):
        b, s, h = x.shape
        tokens = x.reshape(b * s, h)
        gates, _ = self.router(tokens).float().softmax(-1).topk(self.top_k, dim=-1)
        rows = tokens.unsqueeze(1).expand(b * s, self.top_k, h).reshape(-1, h)  # a token's k assignments, in order
        n = rows.shape[0] // self.ep  # to each EP rank, grouped by its experts
        split = [n] * self.ep
        got = all_to_all_rows(rows, split, split, self.group, "dispatch")
        per = n // self.local
        grouped = got.view(self.ep, self.local, per, h).transpose(0, 1).reshape(self.local, self.ep * per, h)
        out = self.experts(grouped).view(self.local, self.ep, per, h).transpose(0, 1).reshape(-1, h)
        back = all_to_all_rows(out, split, split, self.group, "combine")
        y = (back.view(b * s, self.top_k, h) * gates.unsqueeze(-1).to(back.dtype)).sum(1)
        if self.shared is not None:
            y = y + self.shared(tokens)
        return y.view(b, s, h)


class RingSelfAttention(nn.Module):
    """The course GPT's attention (its own q, k, v and proj, so TP's plan splits it as before) on this rank's ``s / cp``
    positions, its core ring attention over the CP group ``group`` in the zig-zag layout (helpers.rank.cp, notebook
    12): q, k, v and the output kept for backward, the K/V blocks passed round the ring."""

    def __init__(self, attn: nn.Module, group):
        super().__init__()
        self.q, self.k, self.v, self.proj = attn.q, attn.k, attn.v, attn.proj
        self.head_dim, self.group = attn.head_dim, group

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (lin(x).view(b, s, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        return self.proj(ring_attention(q, k, v, self.group, causal=True).transpose(1, 2).reshape(b, s, -1))


class ContextParallelStage(Stage):
    """A pipeline stage whose micro-batch holds CP rank ``cp_rank``'s positions of each sequence (zig-zag, notebook
    12): the position embedding reads those positions, not ``0 .. s / cp``."""

    def __init__(self, gpt, blocks: list[int], first: bool, last: bool, cp: int, cp_rank: int):
        super().__init__(gpt, blocks, first, last)
        self.cp, self.cp_rank = cp, cp_rank

    def forward(self, x):
        if self.tok_emb is not None:
            x = self.tok_emb(x) + self.pos_emb(layout_indices("zigzag", x.size(1) * self.cp, self.cp, self.cp_rank))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x)) if self.head is not None else x


def block_plan() -> dict:
    """Megatron's split of one Block with sequence parallelism (course/gpt_tp.py --sp)."""
    seq = Shard(1)  # dim 1 of (batch, seq, d_model)
    return {"ln1": SequenceParallel(), "ln2": SequenceParallel(),
            "attn": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.proj": RowwiseParallel(output_layouts=seq),
            "mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel(output_layouts=seq)}


def edge_plan(first: bool, last: bool) -> dict:
    """Where a stage meets the blocks' sequence-parallel activations: the first block takes the embeddings' whole
    sequence as this rank's shard, the final LayerNorm runs on the shard, and the head gathers it whole again."""
    plan = {"ln_f": SequenceParallel(), "head": PrepareModuleInput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True)} if last else {}
    if first:
        plan["blocks.0"] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                              use_local_output=True)
    return plan


class Recomputed(nn.Module):
    """A block whose activations are recomputed in backward: only its input is kept (torch.utils.checkpoint,
    non-reentrant, as helpers.rank.gpt's ``checkpoint="full"``)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=False)


def build(shape: dict, layers: list[int], first: bool, last: bool, mesh: dict, ep: int = 1,
          recompute: str = "none") -> Stage:
    """On the meta device, the course GPT's blocks ``layers`` (their indices in the whole model) of one stage at
    ``shape`` (``mesh``: device meshes by name): TP + SP over ``mesh["tp"]`` (dense shapes), ring attention over
    ``mesh["cp"]`` where there is one (:class:`RingSelfAttention`), FSDP2 with bf16 compute over ``mesh["dp"]`` (the
    data-parallel ranks, and the CP ranks with them: they hold the same weights); for a ``shape["moe"]`` each block's
    MLP is a :class:`BalancedMoE` over ``mesh["ep"]`` (or, in the first ``dense_layers``, a dense one of
    ``dense_ffn``), its experts sharded over ``mesh["edp"]`` (the dp ranks that hold the same experts)."""
    cfg = GPTConfig(vocab_size=shape["vocab"], seq_len=shape["seq_len"], n_layer=len(layers), n_head=shape["n_head"],
                    d_model=shape["d_model"], attention=shape["attention"])
    moe, tp, cp = shape.get("moe"), mesh["tp"].size(), mesh["cp"].size() if "cp" in mesh else 1
    with torch.device("meta"):  # shapes only: sharded before any storage exists, as torchtitan builds a model
        model = (ContextParallelStage(GPT(cfg), list(range(len(layers))), first, last, cp, mesh["cp"].get_local_rank())
                 if cp > 1 else Stage(GPT(cfg), list(range(len(layers))), first, last))
        for block in model.blocks if cp > 1 else []:
            block.attn = RingSelfAttention(block.attn, mesh["cp"].get_group())
        for block, layer in zip(model.blocks, layers) if moe else []:
            glu = moe.get("matrices", 2) == 3
            block.mlp = (BalancedMoE(cfg.d_model, moe, mesh["ep"].get_group(), ep)
                         if layer >= moe.get("dense_layers", 0) else FeedForward(cfg.d_model, moe["dense_ffn"], glu))
    if tp > 1:
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], block_plan())
    if recompute == "full":  # before sharding, as torchtitan applies activation checkpointing before FSDP2
        model.blocks = nn.ModuleList(Recomputed(block) for block in model.blocks)
    edges = edge_plan(first, last) if tp > 1 else {}
    if edges:  # the first block's input sharded before a Recomputed block keeps it
        parallelize_module(model, mesh["tp"], edges)
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        block = block.block if isinstance(block, Recomputed) else block
        if isinstance(block.mlp, BalancedMoE):
            fully_shard(block.mlp.experts, mesh=mesh["edp"], mp_policy=bf16)
        fully_shard(block, mesh=mesh["dp"], mp_policy=bf16)
    fully_shard(model, mesh=mesh["dp"], mp_policy=bf16)
    return model
