"""Checkers for the exercises of notebooks 03 (DeepSpeed ZeRO) and 04 (DDP vs DeepSpeed).

Each returns a :class:`~helpers.notebook.exercises.Verdict` and never raises; the expected answer is computed from
:mod:`helpers.calc.memory` (the ZeRO paper's formula with DeepSpeed's K, and DeepSpeed's own estimator formula) and
validated configs from :mod:`helpers.calc.dsconfig`, never written down here. Hints name what is missing, not the
answer.

* :func:`check_config_for_budget` (03) -- a ds_config whose model states fit a per-GPU budget, at the lowest ZeRO
  stage that fits (the one that communicates least).
* :func:`check_estimator_gib` (03) -- DeepSpeed's ZeRO-2 estimate for a model, in GiB per GPU.
* :func:`check_smallest_stage` (04) -- which ZeRO stage is the first whose model states fit a budget.
* :func:`check_comm_multiple` (04) -- bytes ZeRO-1/2 send per optimizer step, as a multiple of DDP's.

Example::

    from helpers.notebook.exercises import zero
    zero.check_smallest_stage(2, params=7.5e9, world_size=64, budget_gib=20)
"""
from __future__ import annotations

from typing import Mapping

from ..i18n import _
from . import Verdict, _never_raises, _real_number, _whole_number

GIB = 2**30


def _model_state_bytes(params: float, world_size: int, stage: int, precision: str) -> float:
    from ...calc import memory
    return memory.zero_model_state_bytes(params, world_size, stage, precision,
                                         k=memory.deepspeed_k(stage, precision))["total"]


def _fitting_stages(params: float, world_size: int, budget_gib: float, precision: str = "mixed") -> list[int]:
    return [s for s in (0, 1, 2, 3) if _model_state_bytes(params, world_size, s, precision) <= budget_gib * GIB]


def _number(answer) -> float | None:
    """``answer`` as a finite float (see :func:`helpers.notebook.exercises._real_number`), else None."""
    value = _real_number(answer)
    return None if value is None else float(value)


@_never_raises
def check_config_for_budget(config, *, params: float, world_size: int, budget_gib: float, micro_batch: int,
                            accumulation: int) -> Verdict:
    """Is ``config`` a valid GPU ds_config, in bf16 or fp16 without offload, with ``micro_batch`` x ``accumulation``
    per rank, whose model states per GPU (ZeRO formula, DeepSpeed's K) fit ``budget_gib`` at the lowest stage that fits?

    Example::

        check_config_for_budget({...}, params=1.5e9, world_size=8, budget_gib=12, micro_batch=4, accumulation=8)
    """
    from ...calc import dsconfig, memory
    from ...rank.deepspeed_facts import facts
    if not isinstance(config, Mapping):
        return Verdict(False, _("expected a ds_config dict, got {answer_type}.", answer_type=type(config).__name__),
                       _("Write the config as a Python dict, the same shape as the JSON files above."))
    config = dict(config)
    if not config:
        return Verdict(False, _("the config is empty."),
                       _("Start from the fields of section 2: the batch sizes, the precision section and "
                         "zero_optimization."))
    problems = dsconfig.validate(config, world_size, accelerator="cuda", facts=facts())
    if problems:  # the validator's own message stays English, as it is when launch.deepspeed prints it
        return Verdict(False, _("the validator rejects this config: {problem}", problem=problems[0]),
                       _("Fix what the validator says first (the same checks launch.deepspeed runs before a launch)."))
    sizes = dsconfig.batch_sizes(config, world_size)
    if (sizes["micro_batch"], sizes["accumulation"]) != (micro_batch, accumulation):
        # the numbers of dsconfig's "explanation" line, in a sentence of our own so that it can be translated
        return Verdict(False, _("the batch is not the one asked for (train_batch_size {train_batch_size} = "
                                "{micro_batch} (micro batch per rank) x {accumulation} (accumulation steps) x "
                                "{world_size} (ranks)).",
                                train_batch_size=sizes["train_batch_size"], micro_batch=sizes["micro_batch"],
                                accumulation=sizes["accumulation"], world_size=sizes["world_size"]),
                       _("The exercise fixes {micro_batch} samples per GPU per micro batch and {accumulation} micro "
                         "batches per optimizer step; set train_micro_batch_size_per_gpu and "
                         "gradient_accumulation_steps (and train_batch_size, if you give it, by the batch rule).",
                         micro_batch=micro_batch, accumulation=accumulation))
    zero = config.get("zero_optimization") or {}
    if zero.get("offload_optimizer") or zero.get("offload_param"):
        return Verdict(False, _("the config offloads to CPU memory."),
                       _("Solve it without offload: offload trades step time for GPU memory, and the exercise asks "
                         "for the stage that fits on the GPUs themselves."))
    if not any(isinstance(config.get(k), Mapping) and config[k].get("enabled") for k in ("bf16", "fp16")):
        return Verdict(False, _("the config trains in fp32."),
                       _("The budget is for mixed precision: enable bf16 (or fp16), so weights and gradients take "
                         "2 bytes each and the optimizer keeps the fp32 master copy."))
    stage = int(zero.get("stage", 0))
    need = _model_state_bytes(params, world_size, stage, "mixed")
    fits = _fitting_stages(params, world_size, budget_gib)
    if need > budget_gib * GIB:
        return Verdict(False, _("at stage {stage} the model states need {need_gib:.1f} GiB per GPU, more than the "
                                "{budget_gib:g} GiB budget.", stage=stage, need_gib=need / GIB, budget_gib=budget_gib),
                       _("Partition more of the model states: each higher stage divides one more kind (optimizer "
                         "state, gradients, weights) by the number of GPUs.") if fits else
                       _("Even stage 3 does not fit this budget without offload; check the numbers of the exercise."))
    if fits and stage > fits[0]:
        return Verdict(False, _("stage {stage} fits ({need_gib:.1f} GiB per GPU), but a lower stage fits as well.",
                                stage=stage, need_gib=need / GIB),
                       _("Each stage above the one you need adds communication (ZeRO-3 gathers the weights in every "
                         "forward and backward): compute the formula for the lower stages too."))
    return Verdict(True, _("stage {stage}, {need_gib:.1f} GiB of model states per GPU within {budget_gib:g} GiB "
                           "(ZeRO formula, {k} optimizer bytes per parameter), and the validator accepts the config.",
                           stage=stage, need_gib=need / GIB, budget_gib=budget_gib,
                           k=memory.deepspeed_k(stage, "mixed")))


@_never_raises
def check_estimator_gib(answer, *, params: float, world_size: int) -> Verdict:
    """DeepSpeed's (installed) ZeRO-2 estimate without offload, in GiB per GPU, within 1%.

    Example::

        check_estimator_gib(1.0, params=1e8, world_size=4)
    """
    value = _number(answer)
    if value is None:
        return Verdict(False, _("expected a number of GiB, got {answer!r}.", answer=answer),
                       _("Answer with a number such as 12.5."))
    p, n = float(params), world_size

    def close(nbytes):
        return abs(value - nbytes / GIB) <= 0.01 * nbytes / GIB

    right = 2 * p + 18 * p / n
    if close(right):
        return Verdict(True, _("{right_gib:.2f} GiB per GPU: 2 bytes of 16-bit weights on every GPU, and 18 bytes per "
                               "partitioned parameter (16-bit gradient, fp32 gradient, fp32 master weight, Adam m and "
                               "v).", right_gib=right / GIB))
    wrong = _("{value:g} GiB is not what the installed estimator prints.", value=value)
    if abs(value - right / 1e9) <= 0.01 * right / 1e9:
        return Verdict(False, wrong, _("Right bytes, wrong unit: DeepSpeed divides by 2**30 (GiB), although it "
                                       "labels the column GB."))
    if close(4 * p + 16 * p / n):
        return Verdict(False, wrong, _("That is the formula of older DeepSpeed versions (and of the documentation's "
                                       "printed example): it charges the 16-bit gradient to every GPU, but ZeRO-2 "
                                       "partitions gradients."))
    if close(2 * p + 16 * p / n) or close(2 * p + 14 * p / n):
        return Verdict(False, wrong, _("That is the paper's formula. The estimator also charges the fp32 copy of the "
                                       "gradient partition that the optimizer step works on."))
    if close(18 * p / n) or close(2 * p):
        return Verdict(False, wrong, _("Two terms: one that every GPU holds whole, and one divided by the GPUs."))
    return Verdict(False, wrong, _("Count bytes per parameter: which tensors does every GPU hold whole at stage 2, "
                                   "and which are partitioned? Then divide the bytes by 2**30."))


@_never_raises
def check_smallest_stage(answer, *, params: float, world_size: int, budget_gib: float,
                         precision: str = "mixed") -> Verdict:
    """The lowest ZeRO stage (0-3) whose model states per rank fit ``budget_gib`` (formula, DeepSpeed's K), or None.

    Example::

        check_smallest_stage(None, params=1e12, world_size=8, budget_gib=80)
    """
    fits = _fitting_stages(params, world_size, budget_gib, precision)
    if answer is None:
        if not fits:
            return Verdict(True, _("no stage fits: even ZeRO-3 needs more than the budget without offload."))
        return Verdict(False, _("a stage does fit."),
                       _("Compute the formula for each stage, 0 to 3, before giving up: each one divides more of the "
                         "states by the ranks."))
    stage = _whole_number(answer)
    if stage is None or stage not in (0, 1, 2, 3):
        return Verdict(False, _("expected a stage 0, 1, 2 or 3 (or None), got {answer!r}.", answer=answer),
                       _("Answer with the stage number as an int."))
    need = _model_state_bytes(params, world_size, stage, precision)
    if not fits:
        return Verdict(False, _("stage {stage} needs {need_gib:.1f} GiB per rank.", stage=stage, need_gib=need / GIB),
                       _("Check stage 3 too: if even that does not fit, the answer is None."))
    if stage < fits[0]:
        return Verdict(False, _("stage {stage} needs {need_gib:.1f} GiB per rank, more than {budget_gib:g} GiB.",
                                stage=stage, need_gib=need / GIB, budget_gib=budget_gib),
                       _("Go up a stage: which kind of state does the next stage partition as well?"))
    if stage > fits[0]:
        return Verdict(False, _("stage {stage} fits, but it is not the lowest stage that does.", stage=stage),
                       _("A higher stage costs communication; compute the lower stages' formulas too."))
    return Verdict(True, _("stage {stage}: {need_gib:.1f} GiB of model states per rank, within {budget_gib:g} GiB; "
                           "the stage below does not fit.", stage=stage, need_gib=need / GIB, budget_gib=budget_gib))


@_never_raises
def check_comm_multiple(answer, *, stage: int, accumulation: int) -> Verdict:
    """Bytes one rank sends per optimizer step under ZeRO-``stage`` (1 or 2, DeepSpeed 0.19, fp32, ring algorithms),
    as a multiple of DDP's with ``no_sync()``, when each optimizer step accumulates ``accumulation`` micro batches.

    Example::

        check_comm_multiple(1.0, stage=1, accumulation=4)
    """
    if stage not in (1, 2) or not isinstance(accumulation, int) or accumulation < 1:
        return Verdict(False, _("the exercise asked about stage={stage!r}, accumulation={accumulation!r}.",
                                stage=stage, accumulation=accumulation),
                       _("This checker covers stages 1 and 2 with accumulation >= 1."))
    value = _number(answer)
    if value is None:
        return Verdict(False, _("expected a number, got {answer!r}.", answer=answer),
                       _("Answer with a multiple such as 3.0."))
    reduces = 1 if stage == 1 else accumulation  # gradient all-reduces per optimizer step (DDP: 1)
    right = reduces + 0.5  # + one all-gather of the updated weights: (N-1)/N against the all-reduce's 2(N-1)/N
    if abs(value - right) < 1e-6:
        if reduces > 1:
            return Verdict(True, _("{right:g}x: {reduces} gradient all-reduces per step plus an all-gather of the "
                                   "updated weights, half an all-reduce's bytes.", right=right, reduces=reduces))
        return Verdict(True, _("{right:g}x: {reduces} gradient all-reduce per step plus an all-gather of the "
                               "updated weights, half an all-reduce's bytes.", right=right, reduces=reduces))
    wrong = _("{value:g}x is not it.", value=value)
    if abs(value - reduces) < 1e-6 or abs(value - 1.0) < 1e-6:
        return Verdict(False, wrong, _("After the optimizer step each rank has updated only its partition of the "
                                       "weights: the others need it, and that is one more collective per step."))
    if abs(value - (reduces + 1)) < 1e-6:
        return Verdict(False, wrong, _("An all-gather sends (N-1)/N of the buffer per rank, an all-reduce 2(N-1)/N "
                                       "(reduce-scatter + all-gather): weigh the all-gather accordingly."))
    if stage == 2 and abs(value - 1.5) < 1e-6:
        return Verdict(False, wrong, _("That is ZeRO-1. ZeRO-2 keeps only a partition of the gradients, so it "
                                       "cannot let them add up locally between micro batches: it reduces after each "
                                       "one."))
    if stage == 1 and abs(value - (accumulation + 0.5)) < 1e-6:
        return Verdict(False, wrong, _("ZeRO-1 keeps the whole gradient on every rank, so like DDP with no_sync() it "
                                       "can accumulate locally and reduce once per optimizer step."))
    if stage == 2 and accumulation != 2 and abs(value - 2.5) < 1e-6:
        return Verdict(False, wrong, _("2.5x is what section 3 measured with 2 micro batches per step; here there "
                                       "are {accumulation}.", accumulation=accumulation))
    return Verdict(False, wrong, _("Count the collectives of one optimizer step: how many gradient reductions (one "
                                   "per step or one per micro batch?), and what is gathered after the update."))
