"""A small GPT the course owns: decoder-only, pre-norm, written to be read (the shape of nanoGPT's model).

    tokens -> token embedding + position embedding -> n_layer x Block -> LayerNorm -> head -> logits
    Block:  x = x + proj(attention(ln1(x)))       attention: causal, n_head heads, q/k/v each a Linear
            x = x + down(gelu(up(ln2(x))))          up: d_model -> 4 d_model, down: back

Choices made for the lessons that use it:

* **q, k and v are three Linear layers**, not one fused ``qkv``: tensor parallelism (notebook 09) shards each
  column-wise, and ``view(b, s, -1, head_dim)`` makes every rank see only its own heads.
* **No dropout, no biases in the Linear layers** (LayerNorm keeps its bias): the activation-memory formula of
  notebook 08 has no dropout masks, and the parameter count is ``12 L h^2`` plus small terms (:func:`parameter_count`).
* **The head is untied** from the token embedding: the two can be placed differently by a parallel plan.
* ``attention="math"`` writes softmax(q k^T / sqrt(d)) v out and keeps the s x s scores for backward;
  ``"sdpa"`` calls ``F.scaled_dot_product_attention`` (flash kernel: no s x s tensor is saved).
* ``checkpoint="selective"`` recomputes only the attention core in backward (Korthikanti et al. 2022);
  ``"full"`` recomputes each whole block; both with ``torch.utils.checkpoint``, non-reentrant.
* :meth:`GPT.init_weights` fills every parameter from the seed, so a model built on the meta device and
  materialised later gets exactly the weights of one built normally.

Example::

    cfg = GPTConfig(vocab_size=64, seq_len=32, n_layer=2, n_head=4, d_model=64)
    model = GPT(cfg)
    logits, loss = model(tokens, targets)      # tokens, targets: (batch, seq_len) int64
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

ATTENTIONS = ("math", "sdpa")
CHECKPOINTS = ("none", "selective", "full")


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    seq_len: int  # the longest sequence the position embedding holds
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64
    attention: str = "math"
    checkpoint: str = "none"

    def __post_init__(self):
        if self.d_model % self.n_head:
            raise ValueError(f"d_model {self.d_model} is not a multiple of n_head {self.n_head}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {self.attention!r}")
        if self.checkpoint not in CHECKPOINTS:
            raise ValueError(f"checkpoint must be one of {CHECKPOINTS}, got {self.checkpoint!r}")

    def as_dict(self) -> dict:
        return asdict(self)


def attention_core(q, k, v, attention: str):
    """softmax(q k^T / sqrt(head_dim)) v with a causal mask; q, k, v: (batch, heads, seq, head_dim)."""
    if attention == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    s = q.size(-2)
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))
    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)  # True above the diagonal: the future
    return scores.masked_fill(causal, float("-inf")).softmax(dim=-1) @ v  # softmax's output is saved: b a s^2


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim, self.attention = cfg.d_model // cfg.n_head, cfg.attention
        self.selective = cfg.checkpoint == "selective"
        self.q, self.k, self.v = (nn.Linear(cfg.d_model, cfg.d_model, bias=False) for _ in range(3))
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x):
        b, s, _ = x.shape  # -1 below: the heads this rank holds (all of them, or 1/TP under tensor parallelism)
        q, k, v = (lin(x).view(b, s, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        if self.selective:  # drop the s x s scores, recompute them in backward
            y = checkpoint(attention_core, q, k, v, self.attention, use_reentrant=False)
        else:
            y = attention_core(q, k, v, self.attention)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.up = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=False)
        self.down = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.attn, self.mlp = CausalSelfAttention(cfg), MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if not any(p.is_meta for p in self.parameters()):
            self.init_weights()

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """GPT-2's initialisation, in a fixed order: N(0, 0.02) for embeddings and weights, output projections
        scaled by 1/sqrt(2 n_layer), LayerNorms 1 and 0. ``seed`` given: reseed first (meta-device init)."""
        if seed is not None:
            torch.manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith(("proj.weight", "down.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * self.cfg.n_layer))
            elif ".ln" in name or name.startswith("ln_f"):
                nn.init.ones_(p) if name.endswith("weight") else nn.init.zeros_(p)
            else:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx, targets=None):
        b, s = idx.shape
        if s > self.cfg.seq_len:
            raise ValueError(f"sequence of {s} tokens, but the model holds at most seq_len={self.cfg.seq_len}")
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(s, device=idx.device))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.cfg.checkpoint == "full" else block(x)
        logits = self.head(self.ln_f(x))
        wide = torch.promote_types(logits.dtype, torch.float32)  # bf16 -> fp32; fp64 (a parity twin) stays fp64
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1).to(wide), targets.flatten())
        return logits, loss


def parameter_count(cfg: GPTConfig) -> int:
    """Exact parameter count of ``GPT(cfg)``: per block 12 h^2 (q, k, v, proj: 4 h^2; up, down: 8 h^2) and two
    LayerNorms (4 h); embeddings (V + s) h, the final LayerNorm 2 h, the untied head V h.

    Example::

        parameter_count(cfg) == sum(p.numel() for p in GPT(cfg).parameters())   # True
    """
    h, v = cfg.d_model, cfg.vocab_size
    return cfg.n_layer * (12 * h * h + 4 * h) + (v + cfg.seq_len) * h + 2 * h + v * h
