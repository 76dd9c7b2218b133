"""Checkers for the exercises of notebook 07 (FSDP2).

Each returns a :class:`~helpers.notebook.exercises.Verdict` and never raises; the expected answer is computed from
the exercise's own numbers, never written down here. Hints name what is missing, not the answer.

* :func:`check_sharding_units` -- group a model's layers into FSDP2 sharding units (one ``fully_shard`` each) so
  that the largest unit, gathered whole during its forward, fits a budget, with as few units (all-gathers) as that
  allows.
* :func:`check_resume_batch` -- the ``--batch-size`` that resumes a checkpoint on a different world size and
  continues on exactly the same global batches.

Example::

    from helpers.notebook.exercises import fsdp
    fsdp.check_sharding_units([["a"], ["b", "c"]], layer_params={"a": 10, "b": 4, "c": 4}, budget_params=10)
"""
from __future__ import annotations

from typing import Mapping

from ..i18n import _
from . import Verdict, _never_raises, _whole_number


def _fewest_units(sizes: list[int], budget: int) -> int | None:
    """Fewest consecutive groups whose sums all stay within ``budget`` (greedy is optimal for consecutive groups)."""
    if any(s > budget for s in sizes):
        return None
    units, current = 1, 0
    for s in sizes:
        if current + s > budget:
            units, current = units + 1, 0
        current += s
    return units


@_never_raises
def check_sharding_units(units, *, layer_params: Mapping[str, int], budget_params: int) -> Verdict:
    """Is ``units`` (a list of lists of layer names, in model order) a grouping into sharding units where every
    unit's parameters fit ``budget_params`` when gathered, with the fewest units that allows?

    Example::

        check_sharding_units([["conv1", "conv2"], ["fc1"], ["fc2"]], layer_params=sizes, budget_params=600_000)
    """
    order = list(layer_params)
    if isinstance(units, (str, bytes)) or not isinstance(units, (list, tuple)) or not all(
            isinstance(u, (list, tuple)) and not isinstance(u, (str, bytes)) for u in units):
        return Verdict(False, _("expected a list of lists of layer names, got {answer!r}.", answer=units),
                       _("Write each unit as a list of the layer names it wraps, e.g. [[\"conv1\"], [\"conv2\", "
                         "...]]."))
    flat = [name for u in units for name in u]
    unknown = [n for n in flat if n not in layer_params]
    if unknown:
        if len(unknown) == 1:
            return Verdict(False, _("{unknown} is not a layer of this model.", unknown=unknown),
                           _("The layers are: {layers}.", layers=", ".join(order)))
        return Verdict(False, _("{unknown} are not layers of this model.", unknown=unknown),
                       _("The layers are: {layers}.", layers=", ".join(order)))
    if any(not u for u in units):
        return Verdict(False, _("one of the units is empty."), _("Every fully_shard call wraps at least one layer."))
    missing = [n for n in order if n not in flat]
    twice = sorted({n for n in flat if flat.count(n) > 1})
    if twice:
        return Verdict(False, _("{layers} appear in more than one unit.", layers=twice),
                       _("A parameter belongs to exactly one FSDP module: the innermost fully_shard that wraps it."))
    if missing:
        return Verdict(False, _("{layers} are in no unit.", layers=missing),
                       _("Left out, they would fall to the root unit, which is gathered for the whole step. Put every "
                         "layer in a unit."))
    if flat != order:
        return Verdict(False, _("the layers are not grouped in model order."),
                       _("A unit is one module (a block of consecutive layers), so each unit is a contiguous run of "
                         "layers in forward order."))
    gathered = [sum(layer_params[n] for n in u) for u in units]
    fewest = _fewest_units([layer_params[n] for n in order], budget_params)
    if fewest is None:
        return Verdict(False, _("this model has a single layer larger than the budget."),
                       _("No grouping fits then: a layer is the smallest unit fully_shard can gather."))
    worst = max(range(len(units)), key=lambda i: gathered[i])
    if gathered[worst] > budget_params:
        return Verdict(False, _("unit {unit} gathers {gathered:,} parameters, more than the budget of "
                                "{budget_params:,}.",
                                unit=units[worst], gathered=gathered[worst], budget_params=budget_params),
                       _("Split the largest unit: a unit's parameters are all gathered at once during its forward."))
    if len(units) > fewest:
        return Verdict(False, _("every unit fits, but {units} units mean {units} all-gathers per forward; "
                                "fewer would do.", units=len(units)),
                       _("Each unit is one collective per forward and per backward, and small collectives waste "
                         "latency: merge neighbours as long as the merged unit still fits."))
    return Verdict(True, _("{units} units, the largest gathers {gathered:,} of the "
                           "{budget_params:,}-parameter budget; no grouping that fits has fewer all-gathers.",
                           units=len(units), gathered=gathered[worst], budget_params=budget_params))


@_never_raises
def check_resume_batch(answer, *, global_batch: int, old_world_size: int, new_world_size: int) -> Verdict:
    """Which ``--batch-size`` (per rank) makes a run resumed on ``new_world_size`` ranks continue on the same global
    batches as the ``old_world_size``-rank run that saved the checkpoint?

    Example::

        check_resume_batch(16, global_batch=48, old_world_size=2, new_world_size=3)
    """
    value = _whole_number(answer)
    if value is None:
        return Verdict(False, _("expected a whole number of samples per rank, got {answer!r}.", answer=answer),
                       _("Answer with the number you would pass to --batch-size."))
    if global_batch % new_world_size:
        return Verdict(False, _("no per-rank batch keeps a global batch of {global_batch} on {new_world_size} ranks.",
                                global_batch=global_batch, new_world_size=new_world_size),
                       _("The global batch has to be a multiple of the new world size."))
    right = global_batch // new_world_size
    if value == right:
        return Verdict(True, _("{value} samples x {new_world_size} ranks = the same {global_batch}-sample global "
                               "batches, in the same order: DistributedSampler's rank-strided shards of one batch "
                               "together are always the same slice of the shuffled order.",
                               value=value, new_world_size=new_world_size, global_batch=global_batch))
    wrong = _("--batch-size {value} on {new_world_size} ranks does not continue the same global batches.",
              value=value, new_world_size=new_world_size)
    if value == global_batch // old_world_size:
        return Verdict(False, wrong, _("That is the old per-rank batch. With more ranks it makes every step's global "
                                       "batch larger, and the step count no longer lines up with the checkpoint's."))
    if value == global_batch:
        return Verdict(False, wrong, _("--batch-size is per rank; the global batch is that times WORLD_SIZE."))
    return Verdict(False, wrong, _("What stays fixed across the resume is the global batch; the per-rank batch is "
                                   "what you change to keep it."))
