"""Checkers for the exercises of notebook 05 (tuning); notebook 06's are in :mod:`.faults`.

Every checker returns a :class:`~helpers.notebook.exercises.Verdict` and never raises; hints name the idea that is
missing and never print the expected answer.

* :func:`check_accumulation_step` -- 05: fix a DDP gradient-accumulation step (loss scaling, ``no_sync()``). It
  RUNS the learner's function on a tiny model wrapped in a recorder that plays DDP: it counts the backward passes
  that would all-reduce and compares the accumulated gradient with the big batch's.
* :func:`check_warmup_lr` -- 05: the learning rate DeepSpeed's ``WarmupLR`` (linear) gives an optimizer step.


Example::

    from helpers.notebook.exercises import practice
    practice.check_warmup_lr(0.00015, step=50, lr=3e-4, warmup_steps=100)
"""
from __future__ import annotations

import contextlib
import math

from ..i18n import _
from . import Verdict, _never_raises

# --- 05, exercise 1: the accumulation step -----------------------------------------------------------------------


class _RecordingDDP:
    """Plays a DDP-wrapped model for :func:`check_accumulation_step`: a forward outside ``no_sync()`` is one whose
    backward all-reduces (real DDP decides at forward time too), and every backward is recorded with that flag."""

    def __init__(self, module, events: list):
        self.module = module
        self._events = events
        self._syncing = True

    @contextlib.contextmanager
    def no_sync(self):
        before, self._syncing = self._syncing, False
        try:
            yield
        finally:
            self._syncing = before

    def __call__(self, *args, **kwargs):
        out = self.module(*args, **kwargs)
        syncs = self._syncing
        self._events.append(("forward", syncs))
        if out.requires_grad:
            out.register_hook(lambda grad: self._events.append(("backward", syncs)))
        return out

    forward = __call__

    def parameters(self, *args, **kwargs):
        return self.module.parameters(*args, **kwargs)

    def named_parameters(self, *args, **kwargs):
        return self.module.named_parameters(*args, **kwargs)

    def zero_grad(self, set_to_none: bool = True):
        self._events.append(("zero_grad", None))
        self.module.zero_grad(set_to_none=set_to_none)

    def train(self, mode: bool = True):
        self.module.train(mode)
        return self

    def eval(self):
        return self.train(False)


class _RecordingOptimizer:
    """Records ``zero_grad`` and ``step``; ``step`` keeps a copy of the gradients it would apply."""

    def __init__(self, module, events: list):
        self._module = module
        self._events = events
        self.stepped_grads: list = []
        self.param_groups = [{"params": list(module.parameters()), "lr": 0.1}]

    def zero_grad(self, set_to_none: bool = True):
        self._events.append(("zero_grad", None))
        self._module.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        import torch
        self._events.append(("step", None))
        self.stepped_grads.append(torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                                             for p in self._module.parameters()]))


def _accumulation_setup(micro_batches: int, micro_batch: int):
    import torch
    gen = torch.Generator().manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    x = torch.randn(micro_batches * micro_batch, 6, generator=gen)
    y = torch.randint(0, 3, (micro_batches * micro_batch,), generator=gen)
    return model, x, y


@_never_raises
def check_accumulation_step(train_step, micro_batches: int = 4) -> Verdict:
    """Does ``train_step(model, optimizer, micro_batches)`` do one correct accumulated DDP optimizer step?

    ``micro_batches`` (given to the function) is a list of ``(inputs, labels)`` pairs; the loss is
    ``F.cross_entropy``. Correct means: one ``zero_grad`` before the first backward and none between, one
    backward per micro batch, exactly one all-reducing backward (the last: all others inside ``model.no_sync()``),
    one ``optimizer.step()`` after the last backward, and the gradient it steps with equal to the mean gradient of
    the whole batch (each micro loss divided by the number of micro batches).

    Example::

        >>> import torch.nn.functional as F
        >>> def step(model, optimizer, micro_batches):
        ...     optimizer.zero_grad()
        ...     for x, y in micro_batches:
        ...         F.cross_entropy(model(x), y).backward()
        ...     optimizer.step()
        >>> print(check_accumulation_step(step).message)
        the accumulated gradient is 4.0x the big batch's mean gradient.
    """
    import torch
    import torch.nn.functional as F

    if not callable(train_step):
        return Verdict(False, _("expected a function train_step(model, optimizer, micro_batches), got "
                                "{answer_type}.", answer_type=type(train_step).__name__),
                       _("Define the function in the answer cell (def train_step(...): ...) and pass it, "
                         "without calling it."))
    n = int(micro_batches)
    model, x, y = _accumulation_setup(n, 5)
    events: list = []
    ddp, optimizer = _RecordingDDP(model, events), _RecordingOptimizer(model, events)
    batches = list(zip(x.chunk(n), y.chunk(n)))
    try:
        train_step(ddp, optimizer, batches)
    except Exception as e:  # noqa: BLE001 - the learner's code failed: say so, with its error
        return Verdict(False, _("calling train_step raised {error_type}: {error}", error_type=type(e).__name__,
                                error=e),
                       _("Run the cell and read the error; the function receives a model, an optimizer and a list "
                         "of (inputs, labels) micro batches."))
    kinds = [k for k, _unused in events]
    backwards = [syncs for k, syncs in events if k == "backward"]
    steps = kinds.count("step")
    if not backwards:
        return Verdict(False, _("no backward pass ran."), _("Each micro batch needs its loss's backward()."))
    if steps == 0:
        return Verdict(False, _("optimizer.step() never ran."),
                       _("Accumulating is not skipping the update: step once, after the last micro batch."))
    if steps > 1:
        return Verdict(False, _("optimizer.step() ran {steps} times for {n} micro batches.", steps=steps, n=n),
                       _("That is several small updates, not one big-batch update: step once, after the loop over "
                         "micro batches."))
    first_bw, step_at = kinds.index("backward"), kinds.index("step")
    if "zero_grad" in kinds[first_bw:step_at]:
        return Verdict(False, _("gradients are zeroed between micro batches."),
                       _("zero_grad throws away what earlier micro batches added: zero once, before the first one."))
    if step_at < len(kinds) - 1 - kinds[::-1].index("backward"):
        return Verdict(False, _("optimizer.step() runs before the last backward."),
                       _("The step must see the gradients of every micro batch."))
    if len(backwards) != n:
        return Verdict(False, _("{backwards} backward passes for {n} micro batches.", backwards=len(backwards), n=n),
                       _("One forward and one backward per micro batch, each on its own micro batch."))
    # the gradient: compare with the big batch's mean gradient
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    right = torch.cat([p.grad.flatten() for p in model.parameters()])
    got = optimizer.stepped_grads[0]
    if not torch.allclose(got, right, rtol=1e-4, atol=1e-6):
        ratio = float(got.norm() / right.norm()) if right.norm() > 0 else float("nan")
        if math.isclose(ratio, n, rel_tol=1e-3):
            return Verdict(False, _("the accumulated gradient is {n:.1f}x the big batch's mean gradient.", n=n),
                           _("backward() adds into .grad, so the micro gradients are summed: what must each micro "
                             "loss be scaled by for the sum to be the mean over the whole batch?"))
        if math.isclose(ratio, 1 / n, rel_tol=1e-3):
            return Verdict(False, _("the accumulated gradient is 1/{n} of the big batch's mean gradient.", n=n),
                           _("The loss is scaled twice (or by the square): scale each micro loss once."))
        return Verdict(False, _("the gradient the optimizer steps with is not the big batch's mean gradient."),
                       _("Each micro batch contributes its own loss's gradient, scaled so that the sum over the "
                         "micro batches is the mean over the whole batch."))
    syncing = sum(backwards)
    if syncing == n and n > 1:
        return Verdict(False, _("all {n} backward passes all-reduce: {n} all-reduces of the full gradient for one "
                                "optimizer step.", n=n),
                       _("The gradient is right, but DDP communicates after every backward unless told not to. Which "
                         "DDP context manager lets gradients add up locally? Use it on all micro batches but one."))
    if syncing == 0:
        return Verdict(False, _("no backward pass all-reduces: every micro batch ran inside no_sync()."),
                       _("Then the ranks never exchange gradients and their weights drift apart: the last micro "
                         "batch's forward and backward must run outside it."))
    if syncing > 1:
        return Verdict(False, _("{syncing} of {n} backward passes all-reduce.", syncing=syncing, n=n),
                       _("One all-reduce per optimizer step is enough: keep every micro batch but the last inside "
                         "it."))
    if not backwards[-1]:
        return Verdict(False, _("the all-reducing backward is not the last one."),
                       _("Gradients added after the all-reduce stay on their own rank: the micro batch outside "
                         "no_sync() must be the last."))
    return Verdict(True, _("{n} backward passes, one all-reduce with the last, one optimizer step, and the big "
                           "batch's mean gradient.", n=n))


# --- 05, exercise 2: DeepSpeed's WarmupLR ----------------------------------------------------------------------


def _number(answer) -> float | None:
    if hasattr(answer, "numel") and callable(answer.numel) and answer.numel() == 1:
        answer = answer.item()
    if isinstance(answer, bool) or not isinstance(answer, (int, float)) or not math.isfinite(answer):
        return None
    return float(answer)


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
