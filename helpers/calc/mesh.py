"""Parallel-degree rules (what must divide what): pure arithmetic, checked the same way by the launcher before
anything starts and by the course scripts inside each rank started from a terminal.

A course script declares which of its flags follow which rule, as a literal dict at module level that the launcher
reads without importing or running the script (:mod:`helpers.launch.spec`)::

    LAUNCH_RULES = {"--shard-size": "divides_world_size"}

Each rule name is a key of :data:`RULES`: a function ``(flag, value, world_size) -> problem or None`` of the flag,
its value as given on the command line (a string) and the number of ranks. A new degree flag (tensor or pipeline
parallel) names a rule here; the launcher needs no new code.
"""
from __future__ import annotations

from typing import Callable


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def shard_size_problem(world_size: int, shard_size: int | None) -> str | None:
    """What is wrong with sharding ``world_size`` ranks in groups of ``shard_size`` (None: all of them), or None: the
    same rule the launcher applies before launch (:func:`divides_world_size`), for a script started from a terminal.

        >>> shard_size_problem(4, 2) is None
        True
        >>> shard_size_problem(2, 4)
        '--shard-size 4 does not divide the 2 ranks into equal groups (...); use one of 1, 2'
    """
    return None if shard_size is None else divides_world_size("--shard-size", str(shard_size), world_size)


def divides_world_size(flag: str, value: str, world_size: int) -> str | None:
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
                f"must hold WORLD_SIZE ranks exactly); use one of {_divisors(world_size)}")
    return None


RULES: dict[str, Callable[[str, str, int], str | None]] = {
    "divides_world_size": divides_world_size,
}
