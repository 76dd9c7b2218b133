"""Pipeline parallelism in numbers: which schedules torch offers and how they place stages, the bubble formula, the
bubble measured from a timeline, and the launch rules a pipeline's flags must follow. Pure arithmetic (no torch).

A pipeline cuts the model into stages, one (or, for the interleaved and V-shaped schedules, two) per rank, and cuts
each batch into ``m`` micro-batches. With ``p`` ranks, GPipe and 1F1B leave each rank idle for ``p - 1`` of
``m + p - 1`` slots of a step (equal work per stage, a backward taking any fixed multiple of a forward):

    bubble(p, m) = (p - 1) / (m + p - 1)                                             (:func:`bubble_fraction`)

Measured (:func:`measured_bubble`): per rank, ``1 - busy / span``, busy the summed durations of that rank's forward
and backward actions, span the step from the first action's start on any rank to the last action's end on any rank.
:func:`replay` lays a measured step out again with its measured durations and free communication: the part of the
bubble the schedule and the stages' balance make, without the waits for messages.

Example::

    >>> bubble_fraction(2, 4)
    0.2
    >>> stage_layers(8, 4)
    [[0, 1], [2, 3], [4, 5], [6, 7]]
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from statistics import median

from .flags import divisors, whole

# --schedule -> (torch class in torch.distributed.pipelining, stages per rank, placement of a rank's stages)
#   "loop": rank r holds stages r, r + p, ... (Megatron's interleaving); "v": rank r holds r and 2p - 1 - r
SCHEDULES: dict[str, tuple[str, int, str]] = {
    "gpipe": ("ScheduleGPipe", 1, "loop"),
    "1f1b": ("Schedule1F1B", 1, "loop"),
    "interleaved1f1b": ("ScheduleInterleaved1F1B", 2, "loop"),
    "loopedbfs": ("ScheduleLoopedBFS", 2, "loop"),
    "interleavedzb": ("ScheduleInterleavedZeroBubble", 2, "loop"),
    "zbv": ("ScheduleZBVZeroBubble", 2, "v"),
    "dualpipev": ("ScheduleDualPipeV", 2, "v"),
}

# What every schedule did on gloo ranks in torch 2.14.1 (CPU), measured by tests/test_pp_schedules.py, which re-runs
# each entry on 2 and 4 ranks under a stall timeout with loss parity against one process and fails when torch's
# behaviour no longer matches the record. "status": "runs" | "hangs" | "fails" (then "error": the message, "issue":
# upstream). "min_microbatches": a precondition torch itself enforces when the schedule runs ("stages": at least as
# many micro-batches as stages in all), with torch's own error; the launch rule refuses it before launch.
# Upstream, pipelining used to hang on gloo (pytorch/pytorch#132644, fixed by pytorch/pytorch#152938).
FEASIBILITY: dict[str, dict] = {
    "gpipe": {"status": "runs"},
    "1f1b": {"status": "runs", "min_microbatches": {
        "per": "stages", "error": "must be greater than or equal to the number of stages"}},
    "interleaved1f1b": {"status": "runs"},
    "loopedbfs": {"status": "runs"},
    "interleavedzb": {"status": "runs"},
    "zbv": {"status": "runs"},
    "dualpipev": {"status": "runs", "min_microbatches": {
        "per": "stages", "error": "DualPipeV requires at least as many microbatches as stages"}},
}
GLOO_HANG_ISSUE = "pytorch/pytorch#132644 (fixed by pytorch/pytorch#152938)"


def min_microbatches(schedule: str, p: int) -> int:
    """The fewest micro-batches torch accepts for ``schedule`` on ``p`` ranks (:data:`FEASIBILITY`)."""
    need = FEASIBILITY[schedule].get("min_microbatches")
    return p * SCHEDULES[schedule][1] if need else 1


def feasible_microbatches(schedule: str, p: int) -> int:
    """The micro-batch count the feasibility test runs ``schedule`` with on ``p`` ranks: 2 p, or torch's minimum
    when that is more."""
    return max(2 * p, min_microbatches(schedule, p))


def bubble_fraction(p: int, m: int) -> float:
    """The idle fraction of a GPipe or 1F1B step with ``p`` balanced stages and ``m`` micro-batches."""
    if p < 1 or m < 1:
        raise ValueError(f"need p >= 1 and m >= 1, got p={p}, m={m}")
    return (p - 1) / (m + p - 1)


def stages_of_rank(schedule: str, rank: int, world: int) -> list[int]:
    """The stage indices ``rank`` holds under ``schedule`` on ``world`` ranks (first stage first)."""
    _, per_rank, place = SCHEDULES[schedule]
    if place == "v":
        return [rank, 2 * world - 1 - rank]
    return [rank + k * world for k in range(per_rank)]


def stage_layers(n_layer: int, n_stages: int) -> list[list[int]]:
    """Balanced stages: equal numbers of transformer blocks, block indices per stage. The embeddings ride on the
    first stage and the final LayerNorm + head on the last (small at the course's sizes: counted in the notebook)."""
    if n_layer % n_stages:
        raise ValueError(f"{n_layer} layers do not split into {n_stages} equal stages")
    per = n_layer // n_stages
    return [list(range(s * per, (s + 1) * per)) for s in range(n_stages)]


def measured_bubble(actions: Sequence[Mapping]) -> dict[int, float]:
    """Per rank, ``1 - busy / span`` of one step. ``actions``: dicts with ``rank``, ``t0`` and ``t1`` (seconds, one
    clock); the span runs from the earliest start to the latest end over all ranks."""
    if not actions:
        raise ValueError("no actions")
    start, end = min(a["t0"] for a in actions), max(a["t1"] for a in actions)
    busy: dict[int, float] = {}
    for a in actions:
        busy[a["rank"]] = busy.get(a["rank"], 0.0) + (a["t1"] - a["t0"])
    return {r: 1.0 - b / (end - start) for r, b in sorted(busy.items())}


def steady_bubble(steps: Sequence[Sequence[Mapping]], skip: int = 1, n_stages: int | None = None) -> dict:
    """The bubble of several steps: per step the mean over ranks of :func:`measured_bubble`; the median after the
    first ``skip`` (warm-up) steps, with the spread (min, max). ``n_stages`` given: of each step's :func:`replay`
    instead (communication free)."""
    kept = [sum(b.values()) / len(b) for b in (measured_bubble(replay(s, n_stages) if n_stages else s)
                                               for s in steps[skip:])]
    if not kept:
        raise ValueError(f"{len(steps)} steps leave none after skipping {skip}")
    return {"median": median(kept), "min": min(kept), "max": max(kept), "steps": len(kept)}


def held_microbatches(actions: Sequence[Mapping], stage: int) -> int:
    """The most micro-batches whose activations ``stage`` held at once: forwarded, their backward not yet started
    (the order of the actions' start times; "F" opens a micro-batch, "B" or "I" closes it)."""
    held = peak = 0
    for a in sorted((a for a in actions if a["stage"] == stage), key=lambda a: a["t0"]):
        if a["kind"] == "F":
            held += 1
            peak = max(peak, held)
        elif a["kind"] in ("B", "I"):
            held -= 1
    return peak


def _ready(done: dict, kind: str, stage: int, mb: int, n_stages: int) -> float | None:
    """When the inputs of an action are there (the latest end among them), or None while one is missing."""
    if kind == "F":
        needs = [[("F", stage - 1, mb)]] if stage > 0 else []
    elif kind == "W":
        needs = [[("I", stage, mb)]]
    else:  # B or I: its own forward, and the next stage's input gradient (B or I) unless it is the last stage
        needs = [[("F", stage, mb)]] + ([[("B", stage + 1, mb), ("I", stage + 1, mb)]] if stage < n_stages - 1 else [])
    ends = []
    for options in needs:
        have = [done[k] for k in options if k in done]
        if not have:
            return None
        ends.append(min(have))
    return max(ends, default=0.0)


COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}  # a backward does twice a forward's work (input + weight grads)


def simulate(orders: Mapping[int, Sequence[tuple[str, int, int]]], n_stages: int,
             costs: Mapping[str, float] = COSTS, durations: Mapping[tuple[str, int, int], float] | None = None
             ) -> list[dict]:
    """The plan as a timeline: each rank runs its ``(kind, stage, micro-batch)`` actions in the given order, each as
    soon as it may (a forward after the previous stage's forward of that micro-batch, a backward or input-gradient
    "I" after the next stage's, a weight-gradient "W" after its "I"), taking ``costs[kind]`` time (or, where given,
    ``durations[(kind, stage, micro-batch)]``), with free communication. Returns actions as :func:`measured_bubble`
    reads them."""
    done: dict[tuple[str, int, int], float] = {}
    free = {r: 0.0 for r in orders}
    nxt = {r: 0 for r in orders}
    out: list[dict] = []
    while any(nxt[r] < len(orders[r]) for r in orders):
        moved = False
        for r in orders:
            while nxt[r] < len(orders[r]):
                kind, stage, mb = orders[r][nxt[r]]
                ready = _ready(done, kind, stage, mb, n_stages)
                if ready is None:
                    break
                t0 = max(free[r], ready)
                cost = durations[(kind, stage, mb)] if durations is not None else costs[kind]
                done[(kind, stage, mb)] = free[r] = t0 + cost
                out.append({"rank": r, "kind": kind, "stage": stage, "mb": mb, "t0": t0, "t1": free[r]})
                nxt[r] += 1
                moved = True
        if not moved:
            raise ValueError("the orders deadlock: an action waits for one that never runs")
    return out


def replay(actions: Sequence[Mapping], n_stages: int) -> list[dict]:
    """One measured step replayed with free communication: every rank's actions in the order it ran them, each
    taking the time it measurably took, each starting as soon as its inputs exist (:func:`simulate`). The replay
    keeps what the formula is about (the schedule's order, the stages' balance) and drops what it leaves out (the
    wait between one stage's send and the next stage's start). Started no later than on the clock, every action
    ends no later, so its bubble is never above the measured one: the difference is communication's share."""
    orders: dict[int, list] = {}
    for a in sorted(actions, key=lambda a: a["t0"]):
        orders.setdefault(a["rank"], []).append((a["kind"], a["stage"], a["mb"]))
    durations = {(a["kind"], a["stage"], a["mb"]): a["t1"] - a["t0"] for a in actions}
    return simulate(orders, n_stages, durations=durations)


# ---------------------------------------------------------------------------------------------- launch rules


def _pp(flags: Mapping[str, str], world_size: int) -> int:
    """The pipeline ranks: ``--pp`` (a 3-D mesh), else every rank; 1 when --pp is no number (its rule says so)."""
    pp = whole("--pp", flags.get("--pp", world_size))
    return pp if isinstance(pp, int) else 1


def _stages(flags: Mapping[str, str], world_size: int) -> int | None:
    schedule = flags.get("--schedule", "1f1b")
    return _pp(flags, world_size) * SCHEDULES[schedule][1] if schedule in SCHEDULES else None


def layers_split_over_stages(flag: str, value: str, world_size: int,
                             flags: Mapping[str, str] | None = None) -> str | None:
    """Rule ``"layers_split_over_stages"``: the transformer blocks (``value``) split into equal stages, one per rank
    (two for the interleaved and V-shaped schedules, ``--schedule`` in ``flags``). The problem, or None.

        >>> layers_split_over_stages("--n-layer", "8", 4, {}) is None
        True
        >>> print(layers_split_over_stages("--n-layer", "6", 4, {}))
        --n-layer 6 does not split into 4 equal pipeline stages (1 per rank on 4 pipeline ranks); use --n-layer 4, ...
    """
    layers = whole(flag, value)
    stages = _stages(flags or {}, world_size)
    if isinstance(layers, str) or stages is None:
        return layers if isinstance(layers, str) else None
    if layers % stages:
        near = ", ".join(str(stages * k) for k in range(1, 4))
        pp = _pp(flags or {}, world_size)
        return (f"{flag} {layers} does not split into {stages} equal pipeline stages ({stages // pp} per rank "
                f"on {pp} pipeline ranks); use {flag} {near}")
    return None


def microbatches_split_batch(flag: str, value: str, world_size: int,
                             flags: Mapping[str, str] | None = None) -> str | None:
    """Rule ``"microbatches_split_batch"``: ``value`` micro-batches cut ``--batch-size`` sequences (in ``flags``)
    into equal parts. The problem, or None.

        >>> microbatches_split_batch("--microbatches", "4", 2, {"--batch-size": "8"}) is None
        True
        >>> microbatches_split_batch("--microbatches", "3", 2, {"--batch-size": "8"})
        '--microbatches 3 does not divide --batch-size 8 into equal micro-batches; use --microbatches 1, 2, 4, 8'
    """
    m = whole(flag, value)
    batch = whole("--batch-size", (flags or {}).get("--batch-size", "8"))
    if isinstance(m, str) or isinstance(batch, str):
        return m if isinstance(m, str) else None
    schedule = (flags or {}).get("--schedule", "1f1b")
    pp = _pp(flags or {}, world_size)
    if schedule in SCHEDULES and pp > 1 and m < min_microbatches(schedule, pp):
        need = min_microbatches(schedule, pp)
        return (f"{flag} {m}: --schedule {schedule} needs at least as many micro-batches as stages ({need} on "
                f"{pp} pipeline ranks; torch refuses fewer); use {flag} {need} or more, or --schedule gpipe")
    if batch % m:
        fits = divisors(batch)
        return (f"{flag} {m} does not divide --batch-size {batch} into equal micro-batches; use {flag} {fits}")
    return None


def pp_tp_tile_world(flag: str, value: str, world_size: int, flags: Mapping[str, str] | None = None) -> str | None:
    """Rule ``"pp_tp_tile_world"``: a (dp, pp, tp) mesh, ``--pp`` (``value``) x ``--tp`` ranks per data-parallel
    replica, must tile the world: dp = world_size / (pp x tp) whole. The problem, or None.

        >>> pp_tp_tile_world("--pp", "2", 8, {"--tp": "2"}) is None
        True
        >>> pp_tp_tile_world("--pp", "3", 8, {"--tp": "2"})
        '--pp 3 x --tp 2 = 6 ranks per replica do not tile the 8 ranks (dp = 8 / 6); use --pp 1, 2, 4 with --tp 2'
    """
    pp, tp = whole(flag, value), whole("--tp", (flags or {}).get("--tp", "1"))
    if isinstance(pp, str) or isinstance(tp, str):
        return pp if isinstance(pp, str) else None
    if world_size % (pp * tp):
        fits = divisors(world_size, lambda d: world_size % (d * tp) == 0)
        tps = divisors(world_size)
        return (f"{flag} {pp} x --tp {tp} = {pp * tp} ranks per replica do not tile the {world_size} ranks (dp = "
                f"{world_size} / {pp * tp}); " + (f"use {flag} {fits} with --tp {tp}" if fits else
                                                  f"use --tp {tps}, then a --pp that divides what is left"))
    return None


RULES = {"pp_tp_tile_world": pp_tp_tile_world, "layers_split_over_stages": layers_split_over_stages,
         "microbatches_split_batch": microbatches_split_batch}
