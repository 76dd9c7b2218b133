"""Parallel-degree rules (what must divide what): pure arithmetic, checked the same way by the launcher before
anything starts and by the course scripts inside each rank started from a terminal.

A course script declares which of its flags follow which rule, as a literal dict at module level that the launcher
reads without importing or running the script (:mod:`helpers.launch.spec`)::

    LAUNCH_RULES = {"--shard-size": "divides_world_size"}

Each rule name is a key of :data:`RULES`: a function ``(flag, value, world_size, flags) -> problem or None`` of the
flag, its value as given on the command line (a string), the number of ranks and ``flags``, every flag of the command
line (``{"--tp": "2", "--sp": ""}``, a bare switch maps to ``""``) over the script's ``LAUNCH_DEFAULTS``: a rule that
needs another flag's value (the heads a tensor-parallel degree must divide) reads it there. A flag is checked when it
is given or has a default in ``LAUNCH_DEFAULTS``, a second literal dict of the script (flag -> default, as strings)::

    LAUNCH_RULES = {"--tp": "divides_world_size", "--n-head": "heads_split_over_tp"}
    LAUNCH_DEFAULTS = {"--n-head": "12"}

A new degree flag (tensor or pipeline parallel) names a rule here; the launcher needs no new code.
:func:`script_problem` applies a script's rules; the launcher and the script inside its ranks both call it.
"""
from __future__ import annotations

from typing import Callable, Mapping

from .flags import divisors, whole


def shard_size_problem(world_size: int, shard_size: int | None) -> str | None:
    """What is wrong with sharding ``world_size`` ranks in groups of ``shard_size`` (None: all of them), or None: the
    same rule the launcher applies before launch (:func:`divides_world_size`), for a script started from a terminal.

        >>> shard_size_problem(4, 2) is None
        True
        >>> shard_size_problem(2, 4)
        '--shard-size 4 does not divide the 2 ranks into equal groups (...); use one of 1, 2'
    """
    return None if shard_size is None else divides_world_size("--shard-size", str(shard_size), world_size)


def divides_world_size(flag: str, value: str, world_size: int, flags: Mapping[str, str] | None = None) -> str | None:
    """Rule ``"divides_world_size"``: ``value`` is a whole number of ranks that divides ``world_size`` (a group size
    such as FSDP2's shard size, or a tensor/pipeline-parallel degree). The problem, or None.

        >>> divides_world_size("--shard-size", "2", 4) is None
        True
        >>> divides_world_size("--shard-size", "4", 2)
        '--shard-size 4 does not divide the 2 ranks into equal groups (...); use one of 1, 2'
    """
    try:
        size = int(value)
    except (TypeError, ValueError):
        return f"{flag} must be a whole number of ranks, got {value!r}"
    if not 1 <= size <= world_size or world_size % size:
        return (f"{flag} {size} does not divide the {world_size} ranks into equal groups (groups of that size "
                f"must hold WORLD_SIZE ranks exactly); use one of {divisors(world_size)}")
    return None


def _tp_degree(flags: Mapping[str, str] | None, world_size: int) -> int | None:
    """The tensor-parallel degree of the command line: ``--tp``, else every rank; None when --tp is no number
    (its own rule reports that)."""
    tp = whole("--tp", (flags or {}).get("--tp", world_size))
    return tp if isinstance(tp, int) else None


def heads_split_over_tp(flag: str, value: str, world_size: int, flags: Mapping[str, str] | None = None) -> str | None:
    """Rule ``"heads_split_over_tp"``: the attention heads (``value``) split evenly over the tensor-parallel degree
    (``--tp`` in ``flags``, else ``world_size``): column-parallel q/k/v give each rank whole heads. The problem, or
    None.

        >>> heads_split_over_tp("--n-head", "12", 4, {"--tp": "4"}) is None
        True
        >>> heads_split_over_tp("--n-head", "6", 4, {"--tp": "4"})
        '--n-head 6 heads do not split over --tp 4 ranks (...); use --n-head 4, 8, 12, ... or --tp 1, 2'
    """
    heads = whole(flag, value)
    tp = _tp_degree(flags, world_size)
    if isinstance(heads, str) or tp is None:
        return heads if isinstance(heads, str) else None
    if heads % tp:
        return (f"{flag} {heads} heads do not split over --tp {tp} ranks (column-parallel q/k/v give each rank whole "
                f"heads: heads / tp must be whole); use {flag} {tp}, {2 * tp}, {3 * tp}, ... or --tp "
                f"{divisors(world_size, lambda d: heads % d == 0)}")
    return None


def sequence_splits_over_tp(flag: str, value: str, world_size: int,
                            flags: Mapping[str, str] | None = None) -> str | None:
    """Rule ``"sequence_splits_over_tp"``: with sequence parallelism (``--sp`` in ``flags``) each tensor-parallel rank
    holds ``value / tp`` positions of every sequence, so the sequence length must split evenly; without --sp any
    whole length >= 1 holds. The problem, or None.

        >>> sequence_splits_over_tp("--seq-len", "48", 3, {"--sp": ""}) is None
        True
        >>> sequence_splits_over_tp("--seq-len", "64", 3, {"--sp": ""})
        '--seq-len 64 does not split over --tp 3 ranks under --sp (...); use --seq-len 60, 63, 66, ... or drop --sp'
    """
    length = whole(flag, value)
    tp = _tp_degree(flags, world_size)
    if isinstance(length, str) or tp is None or "--sp" not in (flags or {}):
        return length if isinstance(length, str) else None
    if length % tp:
        near = sorted({max(tp, length // tp * tp - tp), length // tp * tp, length // tp * tp + tp} - {0})
        return (f"{flag} {length} does not split over --tp {tp} ranks under --sp (sequence parallelism gives each rank "
                f"seq_len / tp positions of every sequence); use {flag} {', '.join(map(str, near))}, ... or drop --sp")
    return None


def script_problem(rules: Mapping[str, str], flags: Mapping[str, str], world_size: int) -> str | None:
    """The first problem of a script's ``rules`` (flag -> rule name) with these ``flags`` (the command line's over
    the script's defaults; a flag in neither is not checked), or None: what the launcher refuses before launch and
    the script refuses inside its ranks. A flag given several values (space-separated: a script that runs several
    configurations in one launch) is checked at each of them, with the other flags as given.

        >>> script_problem({"--tp": "divides_world_size"}, {"--tp": "3"}, 4)
        '--tp 3 does not divide the 4 ranks into equal groups (...); use one of 1, 2, 4'
        >>> script_problem({"--tp": "divides_world_size"}, {"--tp": "2 3"}, 4)
        '--tp 3 does not divide the 4 ranks into equal groups (...); use one of 1, 2, 4'
    """
    several = next((f for f, v in flags.items() if len(str(v).split()) > 1), None)
    if several is not None:
        return next((problem for one in str(flags[several]).split()
                     if (problem := script_problem(rules, {**flags, several: one}, world_size))), None)
    for flag, rule in rules.items():
        if flag in flags:
            problem = RULES[rule](flag, flags[flag], world_size, flags)
            if problem:
                return problem
    return None


RULES: dict[str, Callable[[str, str, int, Mapping[str, str] | None], str | None]] = {
    "divides_world_size": divides_world_size,
    "heads_split_over_tp": heads_split_over_tp,
    "sequence_splits_over_tp": sequence_splits_over_tp,
}

from .pipeline import RULES as _PIPELINE_RULES  # noqa: E402  (stages, micro-batches: helpers/calc/pipeline.py)

RULES.update(_PIPELINE_RULES)

from .cp import RULES as _CP_RULES  # noqa: E402  (context parallelism: helpers/calc/cp.py)

RULES.update(_CP_RULES)

from .moe import RULES as _MOE_RULES  # noqa: E402  (mixture of experts, expert parallelism: helpers/calc/moe.py)

RULES.update(_MOE_RULES)
