"""Context parallelism by arithmetic: what one CP rank sends per layer (ring attention and DeepSpeed-Ulysses), how the
causal attention work falls on the ranks under the contiguous and zig-zag layouts, the activations a rank keeps, and
the degree rules course/gpt_cp.py declares (notebook 12 compares each with what :mod:`helpers.rank.cp` counts).

A sequence of ``s`` positions is split over ``W`` CP ranks; a rank holds ``n = s / W`` positions of each of ``b``
sequences, with ``h`` = d_model features (all heads). Per layer and per rank, with ``e`` bytes an element:

* **ring**: forward passes the K and V blocks (``b n h`` each) ``W - 1`` hops, so a rank sends ``2 (W-1) b n h e``;
  backward passes K and V again and the dK/dV accumulators ``W - 1`` hops: ``4 (W-1) b n h e``. Each rank receives as
  much. It grows with ``W`` (a rank's share ``n`` shrinks, the hops grow): the total ``2 (W-1)/W b s h e`` tends to
  the whole sequence's K and V.
* **Ulysses**: forward is four all-to-alls of a ``b n h`` tensor (q, k, v in: heads scattered, sequence gathered; the
  output back), each sending ``(W-1)/W`` of it (the chunk a rank keeps stays): ``4 (W-1)/W b n h e``; backward the
  four again (the output's gradient in, dq, dk, dv back). ``W / 2`` times less than the ring, but needs
  ``heads % W == 0``.

Causal work, in query-key pairs computed per sequence and per head, the way a blockwise kernel computes them (a block
on the diagonal computed whole and masked, a block wholly in the future skipped, a half-visible block only its
visible half): contiguous, rank ``r`` computes ``(r+1) n^2``: the last rank ``W`` times the first, max/mean
``2W/(W+1)``; zig-zag (chunks ``r`` and ``2W-1-r`` of ``2W``, size ``c = s / 2W``), every rank ``(2W+2) c^2``:
balanced. Both add up to ``(W+1) s^2 / 2W``. Ulysses computes ``s^2`` pairs for ``1/W`` of the heads: ``s^2 / W``.

Pure arithmetic (no torch). Example::

    ring_bytes_per_layer(b=8, s=48, d_model=96, cp=4)       # {"forward": 221184, "backward": 442368}
    imbalance(causal_work_pairs(48, 4, "contiguous"))         # 1.6
"""
from __future__ import annotations

from typing import Mapping

from .activations import head_terms, layer_terms
from .flags import divisors, whole

LAYOUTS = ("zigzag", "contiguous")
ATTENTIONS = ("ring", "ulysses")


def _split(s: int, cp: int, layout: str = "contiguous") -> int:
    if cp < 1:
        raise ValueError(f"cp must be at least 1, got {cp}")
    parts = 2 * cp if layout == "zigzag" else cp
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if s % parts:
        raise ValueError(f"seq_len {s} does not split into {parts} equal chunks ({layout}, cp {cp})")
    return s // cp


def ring_bytes_per_layer(b: int, s: int, d_model: int, cp: int, bytes_per_element: int = 4) -> dict[str, float]:
    """Bytes one rank sends (and receives) per layer in ring attention: ``{"forward", "backward"}``."""
    block = b * _split(s, cp) * d_model * bytes_per_element  # K or V of this rank's positions, every head
    return {"forward": 2 * (cp - 1) * block, "backward": 4 * (cp - 1) * block}


def ulysses_bytes_per_layer(b: int, s: int, d_model: int, cp: int, bytes_per_element: int = 4) -> dict[str, float]:
    """Bytes one rank sends (and receives) per layer in Ulysses: four all-to-alls each way."""
    local = b * _split(s, cp) * d_model * bytes_per_element
    return {"forward": 4 * local * (cp - 1) / cp, "backward": 4 * local * (cp - 1) / cp}


def bytes_per_step(attention: str, n_layer: int, b: int, s: int, d_model: int, cp: int,
                   bytes_per_element: int = 4) -> dict[str, float]:
    """What one rank sends per training step for its attention, every layer: ``{"forward", "backward"}``.

        >>> bytes_per_step("ring", 2, 8, 48, 96, 4)["forward"] / bytes_per_step("ulysses", 2, 8, 48, 96, 4)["forward"]
        2.0
    """
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
    per = (ring_bytes_per_layer if attention == "ring" else ulysses_bytes_per_layer)(b, s, d_model, cp,
                                                                                     bytes_per_element)
    return {phase: n_layer * v for phase, v in per.items()}


def rank_per_step(attention: str, layout: str, n_layer: int, b: int, s: int, d_model: int, heads: int, cp: int,
                  cp_rank: int, bytes_per_element: int = 4) -> dict[str, float]:
    """What CP rank ``cp_rank`` sends per training step (``forward``, ``backward``: :func:`bytes_per_step`) and the
    query-key pairs its forward attention computes (``work_pairs``, over the batch, the heads and the layers)."""
    out = bytes_per_step(attention, n_layer, b, s, d_model, cp, bytes_per_element)
    work = causal_work_pairs(s, cp, layout) if attention == "ring" else ulysses_work_pairs(s, cp)
    return {**out, "work_pairs": work[cp_rank] * n_layer * b * heads}


def causal_work_pairs(s: int, cp: int, layout: str) -> list[int]:
    """Query-key pairs each ring rank computes per sequence and head under the causal mask (index: CP rank).

        >>> causal_work_pairs(16, 4, "contiguous"), causal_work_pairs(16, 4, "zigzag")
        ([16, 32, 48, 64], [40, 40, 40, 40])
    """
    n = _split(s, cp, layout)
    if layout == "contiguous":  # r blocks wholly visible, the diagonal one computed whole, the rest skipped
        return [(r + 1) * n * n for r in range(cp)]
    c = n // 2  # the diagonal (2c x 2c, masked) + W-1 blocks of which exactly one half (2c x c) is visible
    return [4 * c * c + (cp - 1) * 2 * c * c for _ in range(cp)]


def ulysses_work_pairs(s: int, cp: int) -> list[float]:
    """Ulysses: every rank the whole ``s x s`` for ``1/cp`` of the heads, per sequence and (model) head."""
    return [s * s / cp] * cp


def imbalance(work) -> float:
    """max / mean of the ranks' work: 1 is balanced; the slowest rank sets the step's time."""
    work = list(work)
    return max(work) * len(work) / sum(work)


def attention_flops(pairs: float, head_dim: int) -> float:
    """Forward flops of ``pairs`` query-key pairs: ``q k^T`` and ``P v``, 2 head_dim each (backward: about 2x)."""
    return 4 * head_dim * pairs


def layer_terms_per_rank(s: int, b: int, h: int, a: int, cp: int, dtype: str = "fp32", attention: str = "ring",
                         core: str = "math") -> dict:
    """One layer's activations on one CP rank, by term: chapter 08's :func:`helpers.calc.activations.layer_terms` at
    ``s / cp`` positions. "ring" keeps what a flash kernel keeps (q, k, v, the output and its log-sum-exp, never an
    s x s block: each is used and dropped). "ulysses" runs the model's own attention ``core`` over the whole sequence
    for ``a / cp`` heads: with "math" it keeps their softmax output, ``e (a / cp) s^2 b``, and the causal mask
    (``s^2`` bools): the s^2 term divides by cp, not by cp^2; with "sdpa", the log-sum-exp instead."""
    n = s // cp
    terms = layer_terms(n, b, h, a, dtype, "sdpa")
    if attention == "ring" or core == "sdpa":
        return terms
    if attention != "ulysses":
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
    e = layer_terms(1, 1, 1, 1, dtype, "math", "full")["block input"]  # bytes per element
    del terms["logsumexp"]
    return {**terms, "softmax output (a / cp heads, whole sequence)": e * a // cp * s * s * b, "causal mask": s * s}


def activation_bytes_per_rank(s: int, b: int, h: int, a: int, cp: int, n_layer: int, vocab: int, dtype: str = "fp32",
                              attention: str = "ring", core: str = "math") -> dict:
    """What one CP rank holds in activations when its forward has just finished: ``layers`` (n_layer x
    :func:`layer_terms_per_rank`), ``head`` (chapter 08's :func:`helpers.calc.activations.head_terms` at
    ``s / cp``: the final LayerNorm, this rank's logits and their log_softmax, its token ids) and ``total``.

        >>> activation_bytes_per_rank(48, 8, 96, 12, 4, 2, 29)["total"] * 4 == activation_bytes_per_rank(
        ...     48, 8, 96, 12, 1, 2, 29)["total"]
        True
    """
    layers = n_layer * sum(layer_terms_per_rank(s, b, h, a, cp, dtype, attention, core).values())
    head = sum(head_terms(s // cp, b, h, vocab, dtype).values())
    return {"layers": layers, "head": head, "total": layers + head}


# ---------------------------------------------------------------------------------------------- degree rules


def cp_degree(flags: Mapping[str, str] | None, world_size: int) -> int | None:
    """The CP degree of a command line: ``--cp``, else ``world_size / --dp``, else every rank (None: not whole)."""
    flags = flags or {}
    if "--cp" in flags:
        cp = whole("--cp", flags["--cp"])
        return cp if isinstance(cp, int) else None
    dp = whole("--dp", flags.get("--dp", "1"))
    return world_size // dp if isinstance(dp, int) and world_size % dp == 0 else None


def cp_dp_tile_world(flag: str, value: str, world_size: int, flags: Mapping[str, str] | None = None) -> str | None:
    """Rule ``"cp_dp_tile_world"``: a (dp, cp) mesh, ``--dp`` (``value``) x ``--cp`` must be the world exactly.

        >>> cp_dp_tile_world("--dp", "2", 4, {"--cp": "2"}) is None
        True
        >>> cp_dp_tile_world("--dp", "2", 4, {"--cp": "4"})
        '--dp 2 x --cp 4 = 8 ranks, but the job has 4; use --dp 1 with --cp 4, or drop one of them'
    """
    dp = whole(flag, value)
    if isinstance(dp, str):
        return dp
    cp = cp_degree(flags, world_size) if "--cp" in (flags or {}) else None
    if cp is None:
        if world_size % dp:
            fits = divisors(world_size)
            return f"{flag} {dp} does not divide the {world_size} ranks (cp = {world_size} / {dp}); use {flag} {fits}"
        return None
    if dp * cp != world_size:
        hint = (f"use {flag} {world_size // cp} with --cp {cp}" if world_size % cp == 0 else
                f"use a --cp that divides {world_size}")
        return f"{flag} {dp} x --cp {cp} = {dp * cp} ranks, but the job has {world_size}; {hint}, or drop one of them"
    return None


def sequence_splits_over_cp(flag: str, value: str, world_size: int,
                            flags: Mapping[str, str] | None = None) -> str | None:
    """Rule ``"sequence_splits_over_cp"``: every CP rank holds ``seq_len / cp`` positions; zig-zag (``--layout``, the
    default) cuts the sequence into ``2 cp`` chunks, so ``value`` must divide by ``2 cp``, contiguous by ``cp``.

        >>> sequence_splits_over_cp("--seq-len", "48", 4, {"--layout": "zigzag"}) is None
        True
        >>> sequence_splits_over_cp("--seq-len", "60", 4, {"--layout": "zigzag"})
        '--seq-len 60 does not split into 2 x --cp 4 = 8 zigzag chunks (...); use --seq-len 56, 64, ... or --layout ...'
    """
    length = whole(flag, value)
    cp = cp_degree(flags, world_size)
    if isinstance(length, str) or cp is None:
        return length if isinstance(length, str) else None
    layout = (flags or {}).get("--layout", "zigzag")
    parts = 2 * cp if layout == "zigzag" else cp
    if length % parts:
        near = ", ".join(str(n) for n in sorted({max(parts, length // parts * parts), length // parts * parts + parts}))
        what = f"2 x --cp {cp} = {parts} zigzag chunks" if layout == "zigzag" else f"--cp {cp} contiguous parts"
        return (f"{flag} {length} does not split into {what} (each CP rank holds seq_len / cp positions"
                f"{', as chunks r and 2cp-1-r' if layout == 'zigzag' else ''}); use {flag} {near}, ..."
                + (" or --layout contiguous" if layout == "zigzag" and length % cp == 0 else ""))
    return None


def heads_split_over_cp(flag: str, value: str, world_size: int, flags: Mapping[str, str] | None = None) -> str | None:
    """Rule ``"heads_split_over_cp"``: under ``--attn ulysses`` each CP rank attends with ``heads / cp`` whole heads,
    so the heads (``value``) must divide by the CP degree (and CP be at most the heads); other attentions: no rule.

        >>> heads_split_over_cp("--n-head", "2", 4, {"--attn": "ulysses"})
        '--n-head 2 heads do not split over --cp 4 ranks under --attn ulysses (...); use --n-head 4, 8, ... or ...'
    """
    heads = whole(flag, value)
    cp = cp_degree(flags, world_size)
    if isinstance(heads, str) or cp is None or (flags or {}).get("--attn") != "ulysses":
        return heads if isinstance(heads, str) else None
    if heads % cp:
        return (f"{flag} {heads} heads do not split over --cp {cp} ranks under --attn ulysses (its all-to-all gives "
                f"each rank heads / cp whole heads{'; CP exceeds the heads' if cp > heads else ''}); use {flag} "
                f"{cp}, {2 * cp}, ... or --attn ring")
    return None


RULES = {"cp_dp_tile_world": cp_dp_tile_world, "sequence_splits_over_cp": sequence_splits_over_cp,
         "heads_split_over_cp": heads_split_over_cp}
