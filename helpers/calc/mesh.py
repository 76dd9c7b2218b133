"""Device-mesh shapes for FSDP2 and HSDP: pure arithmetic, checked the same way by the launcher before anything
starts (:mod:`helpers.launch.spec`) and by ``course/fsdp2_cifar10.py`` inside a rank started from a terminal."""
from __future__ import annotations


def shard_size_problem(world_size: int, shard_size: int | None) -> str | None:
    """What is wrong with sharding ``world_size`` ranks in groups of ``shard_size`` (None: all of them), or None.

    The mesh is (replicas, shard size): it must hold the world exactly, so the shard size divides it.

        >>> shard_size_problem(4, 2) is None
        True
        >>> shard_size_problem(2, 4)
        '--shard-size 4 cannot shard over 2 ranks: ... use one of 1, 2'
    """
    size = world_size if shard_size is None else shard_size
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= world_size or world_size % size:
        divisors = ", ".join(str(d) for d in range(1, world_size + 1) if world_size % d == 0)
        return (f"--shard-size {size} cannot shard over {world_size} ranks: the mesh is (replicas, shard size) and "
                f"must hold WORLD_SIZE ranks exactly; use one of {divisors}")
    return None
