"""The write-the-code exercises of the ZeRO chapters: a ds_config within a model-state budget (03) and ZeRO-1
written by hand (04). Same shape as :mod:`helpers.notebook.exercises.write` (which re-exports both checkers, so a
notebook calls ``write.check_ds_config`` / ``write.check_zero1``): the learner's answer is launched on real ranks and
compared with the reference, each classic mistake named with a hint.
"""
from __future__ import annotations

from ... import launch
from ..i18n import _
from . import Verdict, _never_raises
from .ranks import (PARITY_K, PREAMBLE, by_world, close, function_source, is_stub, launch_problem, one_count_hint,
                    run_on_ranks, stub_verdict)


DS_PARAMS, DS_MICRO, DS_ACCUMULATION = 20_000_000, 4, 2  # the model and batch of the ds_config exercise (03)
DS_ARGS = ["--model", "memory", "--params", DS_PARAMS, "--depth", 8, "--steps", 2, "--dataset", "synthetic",
           "--train-size", 64, "--test-size", 64]


def ds_budget_bytes(world_size: int = 2) -> float:
    """The ds_config exercise's budget of model states per rank, in bf16: halfway between what ZeRO-2 and ZeRO-3
    keep by the formula (DeepSpeed's K) for the exercise's model, so ZeRO-3 is the only stage that fits. Halfway
    leaves room on both sides for what the formula leaves out (03 measures stage 2 at most ~1% above it)."""
    from ...calc import memory
    from ...rank.models import count_parameters, make_memory_model
    params = count_parameters(make_memory_model(DS_PARAMS, 8))
    two, three = (memory.zero_model_state_bytes(params, world_size, stage, "mixed",
                                                k=memory.deepspeed_k(stage, "mixed"))["total"] for stage in (2, 3))
    return (two + three) / 2


@_never_raises
def check_ds_config(config, nproc: int = 2) -> Verdict:
    """Launch ``course/ds_cifar10.py`` with the learner's ds_config on ``nproc`` ranks (a 20M-parameter MLP, micro
    batch 4 per rank, 2 accumulation steps) and check the model states each rank measured against
    :func:`ds_budget_bytes`."""
    from collections.abc import Mapping

    from ...calc import dsconfig
    if not isinstance(config, Mapping) or not config:
        return Verdict(False, _("expected a ds_config dict, got {answer!r}.", answer=config),
                       _("Write the config as a Python dict, the same shape as the JSON files above."))
    config = dict(config)
    try:
        run = launch.deepspeed("course/ds_cifar10.py", nproc=nproc, config=config, args=DS_ARGS, show="none",
                               timeout=600, stall_timeout=180, name="exercise-ds-config")
    except launch.LaunchError as e:
        if e.reason == "invalid":  # refused before anything started, with the validator's own words
            return Verdict(False, _("the launch was refused before it started: {error}", error=str(e)),
                           _("Fix what the refusal says: the same checks run before every launch.deepspeed."))
        return Verdict(False, _("the run failed: {error}", error=str(e).splitlines()[0]),
                       _("Read the error above; start from the fields of section 2."))
    sizes = dsconfig.batch_sizes(config, nproc)
    if (sizes["micro_batch"], sizes["accumulation"]) != (DS_MICRO, DS_ACCUMULATION):
        return Verdict(False, _("it trains, but with {micro} samples per rank per micro batch and {accumulation} "
                                "accumulation steps, not the {want_micro} and {want_accumulation} asked for.",
                                micro=sizes["micro_batch"], accumulation=sizes["accumulation"],
                                want_micro=DS_MICRO, want_accumulation=DS_ACCUMULATION),
                       _("Set train_micro_batch_size_per_gpu and gradient_accumulation_steps (and "
                         "train_batch_size, if you give it, by the batch rule)."))
    budget = ds_budget_bytes(nproc)
    held = max(r["model_state_bytes"]["total"] for r in run.results_by_rank().values())
    stage = int((config.get("zero_optimization") or {}).get("stage", 0))
    if held > budget:
        return Verdict(False, _("at stage {stage} a rank measured {held:.2f} MB of model states, over the "
                                "{budget:.2f} MB budget.", stage=stage, held=held / 1e6, budget=budget / 1e6),
                       _("Partition more of the model states: each higher stage divides one more kind (optimizer "
                         "state, gradients, weights) by the number of ranks; compute the formula for each stage."))
    return Verdict(True, _("stage {stage} on {nproc} ranks: each rank measured at most {held:.2f} MB of model states, "
                           "within the {budget:.2f} MB budget.", stage=stage,
                           nproc=nproc, held=held / 1e6, budget=budget / 1e6))


# --- ZeRO-1 by hand (notebook 04) ----------------------------------------------------------------------------------

# what the exercise cell imports for the learner (registered beside the other exercises' in ranks.PREAMBLE)
PREAMBLE.setdefault("zero1_train", "import torch\nimport torch.distributed as dist\nfrom torch import nn\n"
                                          "from torch.nn.utils import parameters_to_vector, vector_to_parameters\n")
ZERO1_BYTES = 1.5  # ZeRO-1's traffic per step, in DDP's: an all-reduce of the gradients + an all-gather of the weights


@_never_raises
def check_zero1(zero1_train, nproc: int = 2) -> Verdict:
    """Run the learner's ``zero1_train(model, batches)`` (ZeRO-1 by hand: AdamW state for this rank's 1/N of the
    flattened weights only) on ``nproc`` ranks, in float32 and float64; check that every rank ends with DDP's
    weights (one process on every rank's samples; float64 within :func:`helpers.calc.parity.fp64_bound` of the
    floor measured in the same run, float32 within K floors), that each rank's optimizer holds about 1/N of the
    weights, and that a step sends at most 1.5x what DDP's all-reduce sends. It runs on ``nproc + 1`` ranks, then on
    ``nproc`` (a new process group without the last rank): an answer written for one rank count fails the other."""
    from ...calc import parity
    source = function_source(zero1_train, "zero1_train")
    if is_stub(source, "zero1_train"):
        return stub_verdict()
    outcomes, error = run_on_ranks("zero_shard", source, "zero1_train", nproc + 1)
    if any("invalid tensor size" in o.get("error", {}).get("message", "") for o in outcomes.values()):
        return Verdict(False, _("a collective got tensors of different sizes on different ranks."),
                       _("Collectives want the same size on every rank: round the shard size up, "
                         "size = ceil(numel / N), and pad the flat vector with zeros to N x size elements, so every "
                         "shard has the same length (the last one ends in padding)."))
    problem = launch_problem(outcomes, error, _(
        "Every rank must call the same collectives in the same order with tensors of the same size: the all-reduce "
        "and the all-gather on every rank, in every step."), "zero1_train", source)
    if problem is not None:
        return problem
    runs = by_world(outcomes)
    verdicts = {world: _zero1_verdict(runs[world], world) for world in sorted(runs)}
    right = [world for world, v in verdicts.items() if v.ok]
    for world, verdict in verdicts.items():
        if not verdict.ok:  # right at the other rank count: written for one count only
            return Verdict(False, verdict.message, one_count_hint(right[0], world)) if right else verdict
    if len(runs) == 1:
        return verdicts[min(runs)]
    return _zero1_verdict(runs[nproc], nproc, also=max(runs))


def _zero1_verdict(outcomes: dict[int, dict], nproc: int, also: int | None = None) -> Verdict:
    """The verdict on one run of ``nproc`` ranks (right: said for ``also`` ranks too, which were right as well)."""
    from ...calc import parity
    o = outcomes[0]
    numel, world, ref = o["numel"], o["world_size"], o["reference"]
    d32, d64 = (o["runs"][name] for name in ("fp32", "fp64"))
    if d32["steps"] < o["steps"]:
        return Verdict(False, _("{made} optimizer step(s) for {steps} batches.", made=d32["steps"], steps=o["steps"]),
                       _("Build one torch.optim.AdamW over your shard before the loop, and call optimizer.step() "
                         "once per batch."))
    share = -(-numel // world)  # ceil: the largest shard of an even split
    held = max(out["runs"]["fp32"]["held"] for out in outcomes.values())
    if held >= numel:
        return Verdict(False, _("each rank's optimizer holds all {numel} weights: its Adam state is the whole "
                                "model's, on every rank, as in DDP; nothing is saved.", numel=numel),
                       _("Give the optimizer your shard only: one tensor of ceil(numel / N) elements, "
                         "flat[rank * size:(rank + 1) * size].clone().requires_grad_(), and set its .grad to the "
                         "same slice of the averaged gradient."))
    if held > share:
        return Verdict(False, _("a rank's optimizer holds {held} weights, more than its 1/{nproc} share ({share}).",
                                held=held, nproc=nproc, share=share),
                       _("One shard per rank: ceil(numel / N) elements of the flat vector, starting at rank x size."))
    if any(out["runs"][name]["weights"] != o["runs"][name]["weights"] for out in outcomes.values()
           for name in ("fp32", "fp64")):
        return Verdict(False, _("after training, the {nproc} ranks hold different weights.", nproc=nproc),
                       _("Each rank updated only its own shard. After optimizer.step(), all-gather every rank's shard "
                         "(dist.all_gather_into_tensor) into the flat vector and copy it into the model "
                         "(vector_to_parameters), so every rank holds the whole updated model."))
    if d64["weights"] == o["start"]:
        return Verdict(False, _("the model's weights never changed."),
                       _("The optimizer steps your shard, a copy: gather the shards into the flat vector after each "
                         "step and copy it into the model's parameters (vector_to_parameters)."))
    floor = parity.twin_floor((ref["fp32"], ref["fp64"]), (d32["weights"], d64["weights"]))
    bound64 = parity.fp64_bound(floor)
    if close(d64["weights"], ref["summed"], bound64):
        return Verdict(False, _("the weights are what {nproc} x the mean gradient gives: the gradients were summed "
                                "over the ranks, not averaged.", nproc=nproc),
                       _("all_reduce sums; divide by the world size, as DDP does. Adam barely notices (its update "
                         "divides by the gradient's size, so only eps tells the two apart), but SGD and gradient "
                         "clipping would not."))
    if close(d64["weights"], ref["gather_first"], bound64):
        return Verdict(False, _("the model is always one step behind: it was given the shards before they were "
                                "updated."),
                       _("Step first, then gather: optimizer.step() updates your shard, and the all-gather carries "
                         "the updated shards to every rank."))
    untouched = [i for i, (a, b) in enumerate(zip(d64["weights"], o["start"])) if a == b]
    if untouched:
        return Verdict(False, _("{count} of the {numel} weights never changed (elements {first} to {last} of the "
                                "flat vector): no rank's shard holds them.", count=len(untouched), numel=numel,
                                first=untouched[0], last=untouched[-1]),
                       _("numel / N does not divide evenly here, and rounding down drops the remainder. Round the "
                         "shard size up, size = ceil(numel / N), and pad the flat vector to N x size."))
    gap64 = max(abs(a - b) for a, b in zip(d64["weights"], ref["fp64"]))
    gap32 = max(abs(a - b) for a, b in zip(d32["weights"], ref["fp32"]))
    if gap64 > bound64 or gap32 > PARITY_K * floor:
        return Verdict(False, _("the weights are not DDP's: {gap:.2g} from one process on every rank's samples, in "
                                "float64, where rounding allows {bound:.1g}.", gap=gap64, bound=bound64),
                       _("Each step: zero the gradients, backward, the gradients as one padded flat vector, "
                         "all_reduce, divide by N, your slice as the shard's .grad, optimizer.step(), all-gather the "
                         "shards, copy into the model. Use torch.optim.AdamW(..., lr=0.01), as the exercise says."))
    ddp, sent = o["ddp_sent_per_step"], max(out["runs"]["fp32"]["sent_per_step"] for out in outcomes.values())
    padded = world * share / numel  # the padding travels too
    if sent > ZERO1_BYTES * padded * ddp * (1 + 1e-9):
        return Verdict(False, _("the weights are right, but a rank sent {ratio:.2f} x DDP's bytes per step; "
                                "ZeRO-1 needs only {limit:g} x (one all-reduce, one all-gather).", ratio=sent / ddp,
                                limit=ZERO1_BYTES),
                       _("Gather with dist.all_gather_into_tensor: each rank sends its shard to the N-1 others, "
                         "(N-1)/N of the vector, half of what an all-reduce of the whole vector sends."))
    if also is not None:
        return Verdict(True, _("on {nproc} and {also} ranks the weights after {steps} steps are DDP's (on {nproc}: "
                               "largest gap {gap:.1g} in float32, within {k} x the rounding floor {floor:.1g} measured "
                               "in the same run); each rank keeps {state} bytes of AdamW state, {ratio:.2f} of the "
                               "{whole} bytes a whole-model AdamW keeps (about 1/{nproc}), and sends {sent:.2f} x "
                               "DDP's bytes per step.",
                               nproc=nproc, also=also, steps=o["steps"], gap=gap32, k=PARITY_K, floor=floor,
                               state=d32["state_bytes"], ratio=d32["state_bytes"] / o["whole_state_bytes"],
                               whole=o["whole_state_bytes"], sent=sent / ddp))
    return Verdict(True, _("on {nproc} ranks the weights after {steps} steps are DDP's (largest gap {gap:.1g} in "
                           "float32, within {k} x the rounding floor {floor:.1g} measured in the same run); each rank "
                           "keeps {state} bytes of AdamW state, {ratio:.2f} of the {whole} bytes a whole-model AdamW "
                           "keeps (about 1/{nproc}), and sends {sent:.2f} x DDP's bytes per step.",
                           nproc=nproc, steps=o["steps"], gap=gap32, k=PARITY_K, floor=floor,
                           state=d32["state_bytes"], ratio=d32["state_bytes"] / o["whole_state_bytes"],
                           whole=o["whole_state_bytes"], sent=sent / ddp))
