"""Learning-rate schedules as formulas, to check the rates a run reports against what the schedule promises.

Example::

    [deepspeed_warmup_lr(k, 1e-3, 5) for k in range(4)]   # [0.0, 0.0, 0.0002, 0.0004]
"""
from __future__ import annotations

def torch_warmup_lr(k: int, lr: float, warmup_steps: int) -> float:
    """The rate of optimizer step ``k`` (0-based) under ``LambdaLR(opt, lambda s: min(1, s / warmup_steps))``.

    That is ``lr * min(1, k / warmup_steps)``: step 0 runs at 0, full ``lr`` from step ``warmup_steps`` on.

    Example::

        [torch_warmup_lr(k, 1e-3, 4) for k in range(6)]   # [0.0, 0.00025, 0.0005, 0.00075, 0.001, 0.001]
    """
    return lr if warmup_steps <= 0 else lr * min(1.0, k / warmup_steps)


def deepspeed_warmup_lr(k: int, lr: float, warmup_steps: int, min_lr: float = 0.0) -> float:
    """The rate DeepSpeed's ``WarmupLR`` (``warmup_type: "linear"``) gives optimizer step ``k`` (0-based).

    ``WarmupLR`` sets ``min_lr`` when it is built (iteration -1), and ``engine.step()`` advances it after each
    optimizer step to iteration ``i`` with rate ``min_lr + (lr - min_lr) * min(1, i / warmup_steps)``. So step
    ``k`` >= 1 runs at iteration ``k - 1``: one step behind the torch schedule, and with ``min_lr = 0`` the first
    *two* steps change nothing.

    Example::

        [deepspeed_warmup_lr(k, 1e-3, 4) for k in range(6)]   # [0.0, 0.0, 0.00025, 0.0005, 0.00075, 0.001]
    """
    if warmup_steps <= 0:
        return lr
    if k <= 0:
        return min_lr
    return min_lr + (lr - min_lr) * min(1.0, (k - 1) / warmup_steps)
