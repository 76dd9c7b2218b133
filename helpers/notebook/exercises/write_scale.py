"""The exercise of the at-scale chapter (14): choose a layout for a model on a budget of GPUs, checked by simulating
it. Same shape as :mod:`helpers.notebook.exercises.write`, which re-exports it (a notebook calls
``write.check_layout``).

``check_state_bytes``: the bytes of model states one rank holds, by notebook 03's count under FSDP2 and TP.

The layout's answer is in any reasonable form: ``dict(dp=8, tp=8, pp=1)`` (keys in any case, a missing ``pp`` or
``tp`` is 1, a missing ``dp`` is what the others leave), a tuple ``(dp, tp, pp)``, or a string such as
``"dp 8 x tp 8 x pp 1"``. It is refused with its own reason when its degrees do not multiply to the GPUs, when TP
leaves a node, or when the model cannot be split so (:func:`helpers.calc.scale.layout_problem`). Otherwise the first
and the last pipeline stage are simulated (course/gpt_at_scale.py under the fake process group) and must fit the GPU
at their busiest under 1F1B (:func:`helpers.notebook.lessons.at_scale.held`): nothing is taken from a formula.
"""
from __future__ import annotations

import functools
import re
from collections.abc import Mapping

from ...calc import plan, scale
from ..i18n import _
from . import Verdict, _never_raises, _not_a_number, _real_number, _whole_number

TASK = dict(model="llama3-70b", gpus=64, gpus_per_node=8, gpu_bytes=80e9, global_batch=64)
KEYS = ("dp", "tp", "pp")
GIB = 2 ** 30


def read_layout(answer, gpus: int) -> dict | str:
    """``answer`` as {dp, tp, pp} of whole numbers, or the reason it cannot be read (a :func:`_` message)."""
    if isinstance(answer, str):
        found = {k: int(v) for k, v in re.findall(r"\b(dp|tp|pp)\s*[=:]?\s*(\d+)", answer.lower())}
        answer = found or answer
    if isinstance(answer, (tuple, list)) and len(answer) == 3:
        answer = dict(zip(KEYS, answer))
    if not isinstance(answer, Mapping):
        return _("expected a layout such as dict(dp=2, tp=4, pp=8), got {answer!r}.", answer=answer)
    given = {str(k).strip().lower(): v for k, v in answer.items()}
    extra = sorted(set(given) - set(KEYS))
    if extra:
        return _("the layout has {keys}: this task lays the model out over dp, tp and pp only, without "
                 "recomputation.", keys=", ".join(extra))
    if any(v is None for v in given.values()) or not given:
        return _("replace each None with a whole number of ranks.")
    out = {k: _whole_number(v) for k, v in given.items()}
    if any(v is None or v < 1 for v in out.values()):
        return _("each degree is a whole number of ranks, 1 or more; got {answer!r}.", answer=answer)
    out.setdefault("tp", 1)
    out.setdefault("pp", 1)
    if "dp" not in out:
        out["dp"] = gpus // (out["tp"] * out["pp"]) if gpus % (out["tp"] * out["pp"]) == 0 else 0
    return out if out["dp"] else _("tp x pp = {n} does not divide the {gpus} GPUs.", n=out["tp"] * out["pp"],
                                   gpus=gpus)


def _measure(model: str, lay: dict, microbatches: int) -> dict:
    """The first and last stage simulated: {stage: held(...)} (a process a stage, both at once)."""
    from ..lessons.at_scale import first_and_last

    ends = first_and_last(model, lay["dp"], lay["tp"], lay["pp"], microbatches)
    return {stage: h for stage, (_, h) in ends.items()}


@functools.lru_cache(maxsize=8)
def _proposals(model: str, gpu_bytes: float, gpus: int, gpus_per_node: int, global_batch: int) -> list[dict]:
    return plan.propose(scale.MODELS[model], gpu_bytes=gpu_bytes, n_gpus=gpus, gpus_per_node=gpus_per_node,
                        global_batch=global_batch)


def _planner_place(lay: dict, task: dict) -> str:
    fits = _proposals(task["model"], task["gpu_bytes"], task["gpus"], task["gpus_per_node"], task["global_batch"])
    place = next((i for i, f in enumerate(fits) if all(f["layout"][k] == lay[k] for k in KEYS)), None)
    if place is None:
        return _("The planner does not count it among the layouts that fit with its ZeRO stages (it leaves 15% of "
                 "the GPU free).")
    return _("The planner ranks these degrees {place} of the {n} layouts that fit (step {s:.2f} s by its model; "
             "the fastest, {best:.2f} s).", place=place + 1, n=len(fits), s=fits[place]["seconds"]["total"],
             best=fits[0]["seconds"]["total"])


@_never_raises
def check_layout(answer, **task) -> Verdict:
    """Does the layout fit, as simulated? Its refusals and hints name the mistake; see the module docstring."""
    task = {**TASK, **task}
    gpus, node = task["gpus"], task["gpus_per_node"]
    lay = read_layout(answer, gpus)
    if not isinstance(lay, dict):
        return Verdict(False, lay, _("Write the three degrees, for example layout = dict(dp=2, tp=4, pp=8): their "
                                     "product is the number of GPUs."))
    dp, tp, pp = (lay[k] for k in KEYS)
    if dp * tp * pp != gpus:
        return Verdict(False, _("dp x tp x pp = {n}, but the job has {gpus} GPUs.", n=dp * tp * pp, gpus=gpus),
                       _("Every GPU is one rank, at one place on each axis: the product of the degrees is the GPU "
                         "count."))
    if tp > node:
        return Verdict(False, _("tp {tp} spans {nodes} nodes.", tp=tp, nodes=tp // node),
                       _("TP's all-reduces sit in every layer's forward and backward: keep its group inside one "
                         "node of {node} GPUs (NVLink), where they are fast; use dp or pp across nodes.", node=node))
    shape = scale.MODELS[task["model"]]
    problem = scale.layout_problem(shape, gpus, tp, pp, 0)
    if problem:
        return Verdict(False, _("this model cannot be split so: {problem}.", problem=problem),
                       _("A degree must divide what it splits: tp the heads, pp the layers."))
    if task["global_batch"] % dp:
        return Verdict(False, _("dp {dp} does not divide the {b} sequences of a step.", dp=dp,
                                b=task["global_batch"]),
                       _("Each data-parallel replica takes whole sequences: dp must divide the batch."))
    microbatches = task["global_batch"] // dp
    try:
        held = _measure(task["model"], lay, microbatches)
    except (RuntimeError, OSError) as failed:  # the simulation's own failure, not the learner's
        return Verdict(False, _("the simulation itself failed, so nothing was judged: {error}",
                                error=str(failed)[-400:]),
                       _("Run the cell again; if it fails the same way, the course's setup is broken (make setup)."))
    worst_stage, worst = max(held.items(), key=lambda kv: kv[1]["total"])
    figures = ", ".join(f"stage {s}: {h['total'] / GIB:.1f} GiB" for s, h in held.items())
    if worst["total"] > task["gpu_bytes"]:
        message = _("dp {dp} x tp {tp} x pp {pp} does not fit: {figures}, above {gb:.0f} GB ({limit:.1f} GiB).",
                    dp=dp, tp=tp, pp=pp, figures=figures, gb=task["gpu_bytes"] / 1e9,
                    limit=task["gpu_bytes"] / GIB)
        if pp > 1 and worst_stage == 0 and worst["in_flight"] > 1:
            return Verdict(False, message, _(
                "Stage 0 holds {n} micro-batches in flight under 1F1B, {a:.1f} GiB of activations: more stages give "
                "it fewer layers but more micro-batches in flight. Split each micro-batch's activations over more TP "
                "ranks instead (sequence parallelism divides them by tp).", n=worst["in_flight"],
                a=worst["activations"] / GIB))
        return Verdict(False, message, _(
            "Activations dominate ({a:.1f} GiB of the {t:.1f}): sequence parallelism divides them by tp, and a "
            "pipeline stage holds only its layers' share.", a=worst["activations"] / GIB, t=worst["total"] / GIB))
    return Verdict(True, _("dp {dp} x tp {tp} x pp {pp} fits, as simulated: {figures} at the busiest moment of a "
                           "1F1B step with {m} micro-batches. {place}", dp=dp, tp=tp, pp=pp, figures=figures,
                           m=microbatches, place=_planner_place(lay, task)))


@_never_raises
def check_state_bytes(answer, *, layers: int, d_model: int, tp: int, dp: int) -> Verdict:
    """Bytes of parameters, gradients and AdamW state one rank holds for ``layers`` blocks of the course GPT (12 h^2
    parameters each) under TP ``tp`` and FSDP2 over ``dp``: fp32 parameters, fp32 gradients and two fp32 moments,
    4 + 4 + 8 bytes a parameter, over ``tp x dp``. Within 1%; each classic slip gets its hint."""
    value = _real_number(answer)
    if value is None:
        return _not_a_number(answer)
    params = layers * 12 * d_model ** 2 / tp
    right = params * 16 / dp
    close = lambda v: v > 0 and abs(value - v) <= 0.01 * v  # noqa: E731
    if close(right):
        return Verdict(True, _("{answer:.4g} bytes: {layers} blocks x 12 h² / tp = {n:.4g} parameters on a TP rank, x 16 "
                               "bytes (fp32 parameter, gradient and two AdamW moments), / dp {dp}.", answer=value,
                               layers=layers, n=params, dp=dp))
    wrong = _("{answer:.4g} bytes is not it.", answer=value)
    slips = [(right * dp, _("That is before FSDP2 shards them: all three states are divided over the dp ranks.")),
             (right * tp, _("Each TP rank holds 1/tp of every block's matrices.")),
             (right / 8, _("That counts the bf16 parameters only. FSDP2 keeps fp32 parameters (4 bytes), fp32 "
                           "gradients (4) and AdamW's two fp32 moments (8): 16 bytes a parameter.")),
             (right * 12 / 16, _("Count the fp32 gradients too: 4 + 4 + 8 bytes a parameter.")),
             (right / 16, _("That is the number of parameters. Multiply by the bytes each one holds.")),
             (right * 8 / 12, _("A block holds 12 h² parameters: attention's four h x h matrices and the MLP's two "
                                "h x 4h ones."))]
    hints = [hint for v, hint in slips if close(v)]
    return Verdict(False, wrong, hints[0] if hints else _(
        "Count a block's 12 h² parameters, split over tp, at 16 bytes each, then shard over dp."))
