"""Checkers for the exercises of notebook 05 (tuning); notebook 06's are in :mod:`.faults`.

Every checker returns a :class:`~helpers.notebook.exercises.Verdict` and never raises; hints name the idea that is
missing and never print the expected answer.

* :func:`check_warmup_lr` -- 05: the learning rate DeepSpeed's ``WarmupLR`` (linear) gives an optimizer step.


Example::

    from helpers.notebook.exercises import practice
    practice.check_warmup_lr(0.00015, step=50, lr=3e-4, warmup_steps=100)
"""
from __future__ import annotations

import math

from ..i18n import _
from . import Verdict, _never_raises, _real_number

# --- 05, exercise 1: DeepSpeed's WarmupLR ----------------------------------------------------------------------


def _number(answer) -> float | None:
    """``answer`` as a finite float (see :func:`helpers.notebook.exercises._real_number`), else None."""
    value = _real_number(answer)
    return None if value is None else float(value)


@_never_raises
def check_warmup_lr(answer, *, step: int, lr: float, warmup_steps: int) -> Verdict:
    """The rate DeepSpeed's ``WarmupLR`` (``warmup_type: "linear"``, ``warmup_min_lr: 0``) gives optimizer step
    ``step`` (0-based), compared with :func:`helpers.calc.schedules.deepspeed_warmup_lr` to 0.1%.

    Example::

        >>> check_warmup_lr(0.0, step=1, lr=1e-3, warmup_steps=10)
        Correct: DeepSpeed's step 1 runs at 0 (WarmupLR counts from the step after it is built).
    """
    from helpers.calc.schedules import deepspeed_warmup_lr, torch_warmup_lr

    value = _number(answer)
    if value is None:
        return Verdict(False, _("expected a learning rate (a number), got {answer!r} ({answer_type}).",
                                answer=answer, answer_type=type(answer).__name__),
                       _("Answer with a number such as 0.0005."))
    right = deepspeed_warmup_lr(step, lr, warmup_steps)
    same = lambda a, b: math.isclose(a, b, rel_tol=1e-3, abs_tol=1e-12)  # noqa: E731
    if same(value, right):
        return Verdict(True, _("DeepSpeed's step {step} runs at {right:g} (WarmupLR counts from the step after it "
                               "is built).", step=step, right=right))
    wrong = _("{value:g} is not the rate of DeepSpeed's step {step}.", value=value, step=step)
    if same(value, torch_warmup_lr(step, lr, warmup_steps)):
        return Verdict(False, wrong, _("That is LambdaLR's rate for this step. Compare the two lists of first rates "
                                       "printed in section 3: which one is behind, and by how much?"))
    if same(value, lr):
        return Verdict(False, wrong, _("That is the full rate: is this step past the end of the warmup?"))
    if step >= 1 and same(value, deepspeed_warmup_lr(step - 1, lr, warmup_steps)) or \
            same(value, deepspeed_warmup_lr(step + 1, lr, warmup_steps)):
        return Verdict(False, wrong, _("One step off: write the rates of the first three steps down, then count on."))
    if warmup_steps > 1 and same(value, lr * math.log(max(step, 1)) / math.log(warmup_steps)):
        return Verdict(False, wrong, _("That is the log schedule (WarmupLR's default warmup_type); this config asks "
                                       "for \"linear\"."))
    return Verdict(False, wrong, _("The linear warmup rises from warmup_min_lr (0) to the full rate in equal "
                                   "steps; find which point of that ramp this step is at."))
