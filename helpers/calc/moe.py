"""Mixture of experts and expert parallelism by arithmetic: what one EP rank sends per MoE layer, an expert's capacity,
the parameters a rank holds, total against active parameters, load imbalance, and the degree rules course/gpt_moe.py
declares (notebook 13 compares each with what :mod:`helpers.rank.moe` counts).

A rank routes its ``T`` tokens (batch x seq_len) to their top-``k`` of ``E`` experts; ``W`` EP ranks hold ``E / W``
experts each. Per MoE layer, four all-to-alls of token rows of ``h`` = d_model elements, ``e`` bytes each:

* **dispatch, forward**: each kept assignment's row goes to its expert's rank; under uniform routing ``(W-1)/W`` of
  the ``T k`` rows leave the rank: ``T k h e (W-1)/W``.
* **combine, forward**: the outputs come back, as many rows as arrived.
* **backward**: the same two exchanges reversed (the combine's gradient out to the experts, the dispatch's home), so
  the four move ``4 T k h e (W-1)/W``, plus the counts exchanged before each dispatch (``E (W-1)/W`` int64).

With measured counts (:func:`measured_bytes_per_layer`): the rows this rank sends to other ranks (``sent``) and
receives from them (``received``): dispatch forward and combine backward send ``sent`` rows, combine forward and
dispatch backward ``received`` rows.

Capacity: an expert takes at most ``ceil(capacity_factor x T k / E)`` assignments of a group; the rest are dropped.

Pure arithmetic (no torch). Example::

    uniform_bytes_per_layer(tokens=384, top_k=2, d_model=96, ep=4)["dispatch"]["forward"]    # 221184.0
    capacity(384, 2, 4, 1.25)                                                                  # 240
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

from .flags import divisors, whole

EXCHANGES = ("dispatch", "combine")


def capacity(tokens: int, top_k: int, experts: int, capacity_factor: float) -> int:
    """The most assignments one expert takes from a group of ``tokens`` tokens.

        >>> capacity(384, 2, 4, 1.0), capacity(10, 1, 4, 1.0)
        (192, 3)
    """
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
    return math.ceil(capacity_factor * tokens * top_k / experts)


def uniform_bytes_per_layer(tokens: int, top_k: int, d_model: int, ep: int, bytes_per_element: int = 4) -> dict:
    """Bytes one rank sends per MoE layer under uniform routing and no drops: ``{"dispatch"|"combine":
    {"forward"|"backward": bytes}}``, each ``tokens x top_k x d_model x e x (ep-1)/ep``."""
    one = tokens * top_k * d_model * bytes_per_element * (ep - 1) / ep
    return {x: {"forward": one, "backward": one} for x in EXCHANGES}


def measured_bytes_per_layer(sent_rows: int, received_rows: int, d_model: int, bytes_per_element: int = 4) -> dict:
    """Bytes one rank sends per MoE layer given the token rows it sends to other ranks (``sent_rows``) and receives
    from them (``received_rows``) in the forward dispatch.

        >>> measured_bytes_per_layer(10, 7, 2, 4)
        {'dispatch': {'forward': 80, 'backward': 56}, 'combine': {'forward': 56, 'backward': 80}}
    """
    out, back = sent_rows * d_model * bytes_per_element, received_rows * d_model * bytes_per_element
    return {"dispatch": {"forward": out, "backward": back}, "combine": {"forward": back, "backward": out}}


def rows_exchanged(counts: Sequence[Sequence[int]], rank: int, experts_per_rank: int) -> tuple[int, int]:
    """(rows ``rank`` sends to other ranks, rows it receives from them) from ``counts[src][expert]``: the kept
    assignments each rank routes to each expert (expert e lives on rank ``e // experts_per_rank``)."""
    sent = sum(n for e, n in enumerate(counts[rank]) if e // experts_per_rank != rank)
    received = sum(row[e] for src, row in enumerate(counts) if src != rank
                   for e in range(rank * experts_per_rank, (rank + 1) * experts_per_rank))
    return sent, received


def count_bytes_per_layer(experts: int, ep: int, bytes_per_count: int = 8) -> int:
    """The per-expert counts exchanged before a dispatch (int64), the part that leaves the rank."""
    return experts * bytes_per_count * (ep - 1) // ep


def expert_parameters(d_model: int) -> int:
    """One expert: the GPT's MLP, up (h x 4h) and down (4h x h), no biases: ``8 h^2``."""
    return 8 * d_model * d_model


def parameters(dense: int, n_layer: int, d_model: int, experts: int, top_k: int, ep: int = 1) -> dict:
    """Parameter counts of a GPT whose MLPs are MoE layers: ``dense`` (everything but the MLPs and routers),
    ``total`` (every expert), ``active`` (what one token uses: k experts per layer), ``per_rank`` (under EP: the
    dense part and routers replicated, E / ep experts per layer).

        >>> parameters(1000, 2, 8, 4, 1, ep=2)["total"] - parameters(1000, 2, 8, 4, 1, ep=2)["per_rank"]
        2048
    """
    if experts % ep:
        raise ValueError(f"{experts} experts do not split over ep {ep}")
    router, one = d_model * experts, expert_parameters(d_model)
    return {"dense": dense, "total": dense + n_layer * (router + experts * one),
            "active": dense + n_layer * (router + top_k * one),
            "per_rank": dense + n_layer * (router + experts // ep * one)}


def imbalance(load: Sequence[float]) -> float:
    """max / mean of the experts' (or ranks') load: 1 is balanced; the busiest expert sets the layer's time."""
    load = list(load)
    return max(load) * len(load) / sum(load)


# ---------------------------------------------------------------------------------------------- degree rules


def ep_degree(flags: Mapping[str, str] | None, world_size: int) -> int | None:
    """The EP degree of a command line: ``--ep``, else ``world_size / --dp``, else every rank (None: not whole)."""
    flags = flags or {}
    if "--ep" in flags:
        ep = whole("--ep", flags["--ep"])
        return ep if isinstance(ep, int) else None
    dp = whole("--dp", flags.get("--dp", "1"))
    return world_size // dp if isinstance(dp, int) and world_size % dp == 0 else None


def ep_dp_tile_world(flag: str, value: str, world_size: int, flags: Mapping[str, str] | None = None) -> str | None:
    """Rule ``"ep_dp_tile_world"``: a (dp, ep) mesh, ``--dp`` (``value``) x ``--ep`` must be the world exactly.

        >>> ep_dp_tile_world("--dp", "2", 4, {"--ep": "4"})
        '--dp 2 x --ep 4 = 8 ranks, but the job has 4; use --dp 1 with --ep 4, or drop one of them'
    """
    dp = whole(flag, value)
    if isinstance(dp, str):
        return dp
    if "--ep" not in (flags or {}):
        if world_size % dp:
            return f"{flag} {dp} does not divide the {world_size} ranks (ep = {world_size} / {dp}); use {flag} " \
                   f"{divisors(world_size)}"
        return None
    ep = ep_degree(flags, world_size)
    if ep is not None and dp * ep != world_size:
        hint = f"use {flag} {world_size // ep} with --ep {ep}" if world_size % ep == 0 else \
            f"use an --ep that divides {world_size}"
        return f"{flag} {dp} x --ep {ep} = {dp * ep} ranks, but the job has {world_size}; {hint}, or drop one of them"
    return None


def experts_split_over_ep(flag: str, value: str, world_size: int, flags: Mapping[str, str] | None = None):
    """Rule ``"experts_split_over_ep"``: each EP rank holds ``experts / ep`` whole experts.

        >>> experts_split_over_ep("--experts", "6", 4, {})
        '--experts 6 do not split over --ep 4 ranks (...); use --experts 4, 8, 12, ... or --ep 1, 2'
    """
    experts = whole(flag, value)
    ep = ep_degree(flags, world_size)
    if isinstance(experts, str) or ep is None:
        return experts if isinstance(experts, str) else None
    if experts % ep:
        return (f"{flag} {experts} do not split over --ep {ep} ranks (each EP rank holds experts / ep whole experts); "
                f"use {flag} {ep}, {2 * ep}, {3 * ep}, ... or --ep {divisors(world_size, lambda d: experts % d == 0)}")
    return None


def top_k_at_most_experts(flag: str, value: str, world_size: int, flags: Mapping[str, str] | None = None):
    """Rule ``"top_k_at_most_experts"``: a token picks ``k`` different experts, so ``1 <= k <= experts``.

        >>> top_k_at_most_experts("--top-k", "3", 4, {"--experts": "2"})
        '--top-k 3 exceeds the 2 experts (a token picks k different experts); use --top-k 1 to 2, or more --experts'
    """
    k = whole(flag, value)
    experts = whole("--experts", (flags or {}).get("--experts", "1"))
    if isinstance(k, str) or isinstance(experts, str):
        return k if isinstance(k, str) else None
    if k > experts:
        return (f"{flag} {k} exceeds the {experts} experts (a token picks k different experts); use {flag} 1 to "
                f"{experts}, or more --experts")
    return None


def capacity_factor_positive(flag: str, value: str, world_size: int, flags: Mapping[str, str] | None = None):
    """Rule ``"capacity_factor_positive"``: capacity = ceil(factor x T k / E) must be a positive number of slots.

        >>> capacity_factor_positive("--capacity-factor", "0", 4)
        '--capacity-factor 0 leaves the experts no room (...); use a number > 0, such as 1.25'
    """
    try:
        factor = float(value)
    except (TypeError, ValueError):
        return f"{flag} must be a number, got {value!r}; use a number > 0, such as 1.25"
    if not factor > 0:
        return (f"{flag} {value} leaves the experts no room (capacity = ceil(factor x tokens x k / experts)); use a "
                f"number > 0, such as 1.25")
    return None


RULES = {"ep_dp_tile_world": ep_dp_tile_world, "experts_split_over_ep": experts_split_over_ep,
         "top_k_at_most_experts": top_k_at_most_experts, "capacity_factor_positive": capacity_factor_positive}
