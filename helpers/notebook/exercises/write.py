"""Write-the-code exercises: the learner writes the distributed lines, and the checker runs them on real ranks.

Each checker takes the learner's function, saves its source (after the imports the exercise cell gives) into a
file, launches a task script from :mod:`helpers.rank.exercises` on 2-3 gloo ranks with :func:`helpers.launch.torchrun`,
and compares what every rank recorded with what the reference must give. A wrong answer gets the hint for the
classic mistake it shows; a function that is still the exercise's stub is answered without launching anything.

The reference solutions are in :mod:`helpers.notebook.exercises.solutions`; :func:`solution` shows one, on request.

Example::

    from helpers.notebook.exercises import write
    def ring_all_reduce(tensor):
        ...                                   # your lines
    write.check_ring_all_reduce(ring_all_reduce)
"""
from __future__ import annotations

import inspect
import tempfile
from pathlib import Path

from ... import launch
from ...rank.exercises.resume import KILLED
from ..i18n import _
from . import Verdict, _never_raises
from .ranks import (PARITY_K, PREAMBLE, close, function_source, is_stub, launch_problem, parity_bound, run_on_ranks,
                    stub_verdict)

@_never_raises
def check_ring_all_reduce(ring_all_reduce, nproc: int = 3) -> Verdict:
    """Run the learner's ``ring_all_reduce(tensor)`` (sum in place, from send/recv only) on ``nproc`` ranks for a
    tensor that splits evenly, one that does not, and one shorter than the number of ranks; check the sums, that
    no built-in collective was called, and that the ranks together sent 2(N-1) times the tensor, as the ring does."""
    source = function_source(ring_all_reduce, "ring_all_reduce")
    if is_stub(source, "ring_all_reduce"):
        return stub_verdict()
    outcomes, error = run_on_ranks("ring", source, "ring_all_reduce", nproc)
    problem = launch_problem(outcomes, error, _(
        "A blocking dist.send returns only once the message is on its way; if every rank sends a large chunk "
        "before any rank receives, all of them wait. Post the receive too: dist.isend + dist.irecv, then wait on "
        "both."), "ring_all_reduce", source)
    if problem is not None:
        return problem
    used = sorted({name for o in outcomes.values() for name in o["built_ins"]})
    if used:
        return Verdict(False, _("your function called dist.{names}, which does the work for you.",
                                names=", dist.".join(used)),
                       _("Build it from point-to-point messages only: dist.send/dist.recv or dist.isend/dist.irecv "
                         "to the next and from the previous rank in the ring."))
    n_cases = len(outcomes[0]["cases"])
    for i in range(n_cases):
        cases = [outcomes[r]["cases"][i] for r in sorted(outcomes)]
        numel = cases[0]["numel"]
        if all(c["correct"] for c in cases):
            continue
        wrong = _("with {numel} elements on {nproc} ranks, not every rank holds the sum.", numel=numel, nproc=nproc)
        if not all(c["shape_ok"] for c in cases):
            return Verdict(False, wrong, _("Keep the tensor's shape: sum into the tensor you were given (in place), "
                                           "like dist.all_reduce."))
        if all(c["is_mean"] for c in cases):
            return Verdict(False, wrong, _("That is the mean. all_reduce(SUM) adds; DDP divides by the world size "
                                           "afterwards, outside the collective."))
        if all(c["unchanged"] for c in cases):
            return Verdict(False, wrong, _("The tensor did not change. Add what you receive into your own chunk, "
                                           "and write the finished chunks back into the tensor."))
        if any(0 < c["elements_right"] for c in cases):
            return Verdict(False, wrong, _("Some chunks are right and others not. After N-1 reduce-scatter steps each "
                                           "rank holds one finished chunk; N-1 all-gather steps pass the finished "
                                           "chunks on round the ring, overwriting, not adding."))
        return Verdict(False, wrong, _("At step s, rank r sends chunk (r - s) mod N to rank r + 1 and adds the chunk "
                                       "it receives from rank r - 1 into its own copy."))
    ring_total = [2 * (nproc - 1) * outcomes[0]["cases"][i]["bytes"] for i in range(n_cases)]
    sent_total = [sum(outcomes[r]["cases"][i]["sent_bytes"] for r in outcomes) for i in range(n_cases)]
    if any(s > t for s, t in zip(sent_total, ring_total)):
        i = next(i for i in range(n_cases) if sent_total[i] > ring_total[i])
        return Verdict(False, _("the sums are right, but the ranks sent {sent} bytes for a {size}-byte tensor; a ring "
                                "sends 2(N-1) x {size} = {ring} in all.", sent=sent_total[i],
                                size=outcomes[0]["cases"][i]["bytes"], ring=ring_total[i]),
                       _("Send one chunk (1/N of the tensor) per step, not the whole tensor: N-1 steps of "
                         "reduce-scatter, then N-1 of all-gather."))
    even = outcomes[0]["cases"][0]
    per_rank = sum(outcomes[r]["cases"][0]["sent_bytes"] for r in outcomes) / nproc / even["bytes"]
    return Verdict(True, _("on {nproc} ranks every rank holds the sum for {n_cases} tensor sizes, from send/recv "
                           "alone; each rank sent {per_rank:.3f} x the tensor, which is 2(N-1)/N = {formula:.3f}.",
                           nproc=nproc, n_cases=n_cases, per_rank=per_rank, formula=2 * (nproc - 1) / nproc))


@_never_raises
def check_ddp_train(train, nproc: int = 2) -> Verdict:
    """Run the learner's ``train(model, dataset, epochs)`` on ``nproc`` ranks, each rank's model built from a
    different seed; check that the replicas end identical, that the ranks split each epoch's samples between them,
    that each epoch is shuffled anew, and that the weights moved."""
    source = function_source(train, "train")
    if is_stub(source, "train"):
        return stub_verdict()
    outcomes, error = run_on_ranks("ddp_train", source, "train", nproc)
    problem = launch_problem(outcomes, error, _("Every rank must run the same collectives in the same order; "
                                                  "DDP's backward all-reduces on every rank, so every rank must "
                                                  "train on the same number of batches."), "train", source)
    if problem is not None:
        return problem
    ranks = sorted(outcomes)
    first = outcomes[ranks[0]]
    if all(o["final"] in (o["start"], first["start"]) for o in outcomes.values()):  # DDP starts from rank 0's
        return Verdict(False, _("the weights never changed."), _("Keep the loop's backward() and optimizer.step()."))
    if any(outcomes[r]["final"] != first["final"] for r in ranks):
        return Verdict(False, _("after training, the {nproc} ranks hold different models.", nproc=nproc),
                       _("Wrap the model in DDP(model) before training: it broadcasts rank 0's weights at the start "
                         "and averages the gradients in every backward, so the replicas stay identical."))
    samples = first["samples"]
    for epoch in range(len(first["reads"])):
        reads = [outcomes[r]["reads"][epoch] for r in ranks]
        if all(len(set(rd)) == samples for rd in reads):
            return Verdict(False, _("every rank read all {samples} samples in epoch {epoch}, so the ranks did the "
                                    "same work {nproc} times.", samples=samples, epoch=epoch, nproc=nproc),
                           _("Give the DataLoader a DistributedSampler(dataset): each rank then reads its own "
                             "1/N of the samples."))
        union = set().union(*map(set, reads))
        if len(union) < samples or sum(map(len, reads)) > samples + nproc:
            return Verdict(False, _("in epoch {epoch} the ranks read {read} samples between them, {distinct} "
                                    "distinct, of {samples}.", epoch=epoch, read=sum(map(len, reads)),
                                    distinct=len(union), samples=samples),
                           _("Let a DistributedSampler split the data: one per rank, built from the whole dataset."))
    if len(first["reads"]) > 1 and all(o["reads"][0] == o["reads"][1] for o in outcomes.values()):
        return Verdict(False, _("every rank read its samples in the same order in both epochs."),
                       _("Call sampler.set_epoch(epoch) at the start of each epoch: the sampler's shuffle is seeded "
                         "by the epoch, so without it every epoch repeats the first one's order."))
    return Verdict(True, _("on {nproc} ranks that started from different weights, the replicas end identical, each "
                           "epoch's {samples} samples are split between the ranks, and each epoch is shuffled anew.",
                           nproc=nproc, samples=samples))


@_never_raises
def check_fully_shard(shard, nproc: int = 2) -> Verdict:
    """Run the learner's ``shard(model) -> (model, optimizer)`` on ``nproc`` ranks; check that each rank holds about
    1/N of the parameters, that every block and the root are FSDP units, that the optimizer holds the sharded
    parameters, and that three steps follow one process's losses within a floor measured in the same run."""
    source = function_source(shard, "shard")
    if is_stub(source, "shard"):
        return stub_verdict()
    outcomes, error = run_on_ranks("fsdp_shard", source, "shard", nproc)
    problem = launch_problem(outcomes, error, _("Every rank must shard the same modules in the same order: "
                                                  "fully_shard's gathers are collectives."), "shard", source)
    if problem is not None:
        return problem
    o = outcomes[0]
    if not o["optimizer"]:
        return Verdict(False, _("shard returned no optimizer."), _("Return both: (model, optimizer)."))
    if not o["optimizer_has_model_params"]:
        return Verdict(False, _("the optimizer does not hold the model's parameters."),
                       _("Build the optimizer after fully_shard: sharding replaces every parameter with a sharded "
                         "one (a DTensor), and an optimizer built before still updates the old, unused tensors."))
    if o["local_bytes"] >= o["full_bytes"]:
        return Verdict(False, _("each rank still holds all {full} bytes of parameters.", full=o["full_bytes"]),
                       _("Call fully_shard(module) on each block, then on the whole model."))
    if not o["root_is_unit"] or o["local_bytes"] > o["shard_bytes"]:
        return Verdict(False, _("each rank holds {local} bytes of parameters, more than its 1/{nproc} share "
                                "({share}).", local=o["local_bytes"], nproc=nproc, share=o["shard_bytes"]),
                       _("Finish with fully_shard(model) on the root: it shards what no block owns (here the last "
                         "Linear layer), and starts and ends each step's communication."))
    if o["units"] < o["blocks"] + 1:
        return Verdict(False, _("the model is {units} FSDP unit(s); with {blocks} blocks it should be {want}.",
                                units=o["units"], blocks=o["blocks"], want=o["blocks"] + 1),
                       _("fully_shard each block before the root. With one unit the whole model is gathered at once "
                         "for the forward pass, so every full weight is in memory together; per block, only one "
                         "block's weights are whole at a time."))
    floor, tolerance = parity_bound(o["reference"]["fp32"], o["reference"]["fp64"])
    drift = max(abs(a - b) for a, b in zip(o["losses"], o["reference"]["fp32"]))
    if drift > tolerance:
        return Verdict(False, _("the sharded run's loss is {drift:.2g} from one process's, more than {k} x the "
                                "rounding floor {floor:.2g} measured in the same run.", drift=drift, k=PARITY_K,
                                floor=floor),
                       _("Use the optimizer the exercise gives, torch.optim.SGD(model.parameters(), lr=0.05), "
                         "built after sharding."))
    return Verdict(True, _("each of the {nproc} ranks holds {local} of the model's {full} parameter bytes ({ratio:.2f}, "
                           "about 1/{nproc}) in {units} FSDP units, and three steps follow one process's loss (largest gap "
                           "{drift:.1g}, within {k} x the rounding floor {floor:.1g} measured in the same run).",
                           nproc=nproc, local=o["local_bytes"], full=o["full_bytes"],
                           ratio=o["local_bytes"] / o["full_bytes"], units=o["units"], drift=drift, k=PARITY_K,
                           floor=floor))


@_never_raises
def check_accumulation(train_step, nproc: int = 2) -> Verdict:
    """Run the learner's ``train_step(model, optimizer, micro_batches)`` (``model`` is DDP) for two steps on
    ``nproc`` ranks; check that each step all-reduces once per bucket, not once per micro-batch, and that the weights
    are one process's on every rank's samples, within a rounding floor measured in the same run."""
    source = function_source(train_step, "train_step")
    if is_stub(source, "train_step"):
        return stub_verdict()
    outcomes, error = run_on_ranks("accumulation", source, "train_step", nproc)
    problem = launch_problem(outcomes, error, _("Every rank must make the same number of backward passes, and run "
                                                  "the same ones inside no_sync."), "train_step", source)
    if problem is not None:
        return problem
    o, micro = outcomes[0], outcomes[0]["micro_batches"]
    ref = o["reference"]
    floor, tolerance = parity_bound(ref["fp32"], ref["fp64"])
    per_step, buckets = o["all_reduces"], o["buckets"]
    if any(n == 0 for n in per_step):
        return Verdict(False, _("a step made no all-reduce at all, so each rank stepped on its own gradients."),
                       _("Run the last micro-batch's backward outside no_sync(): that backward is where DDP "
                         "all-reduces the gradients accumulated so far."))
    if any(close(out["weights"], ref["unscaled"], tolerance) for out in outcomes.values()):
        return Verdict(False, _("the weights moved {micro} times too far: the micro-batch gradients were added, "
                                "not averaged.", micro=micro),
                       _("Divide each micro-batch's loss by the number of micro-batches before backward()."))
    if any(close(out["weights"], ref["last_only"], tolerance) for out in outcomes.values()):
        return Verdict(False, _("only the last micro-batch of each step reached the optimizer."),
                       _("Zero the gradients once per optimizer step, before the first micro-batch, not before "
                         "every one: backward() adds into .grad, and that sum is the accumulation."))
    if not all(close(out["weights"], ref["fp32"], tolerance) for out in outcomes.values()):
        return Verdict(False, _("the weights are not what one process gets from the same samples."),
                       _("For each micro-batch: forward, loss / number of micro-batches, backward (inside no_sync "
                         "for all but the last); then one optimizer.step()."))
    if any(n > buckets for n in per_step):
        said = _("the weights are right, but each step made {made} all-reduces where {buckets} would do.",
                 made=max(per_step), buckets=buckets)
        if "no_sync" in source:
            return Verdict(False, said, _("Run the forward pass inside no_sync() too, not only backward(): DDP "
                                          "decides in forward whether the coming backward will all-reduce."))
        return Verdict(False, said, _("Run every micro-batch but the last (forward and backward) inside "
                                      "`with model.no_sync():`, so DDP all-reduces once per step instead of once "
                                      "per micro-batch."))
    return Verdict(True, _("each step of {micro} micro-batches all-reduced {buckets} time(s), as one backward "
                           "does, and the weights on all {nproc} ranks match one process's on every rank's samples "
                           "(within {k} x the rounding floor {floor:.1g} measured in the same run).", micro=micro,
                           buckets=buckets, nproc=nproc, k=PARITY_K, floor=floor))


@_never_raises
def check_resumable(save_checkpoint, load_checkpoint, nproc: int = 2) -> Verdict:
    """Run a DDP loop with the learner's ``save_checkpoint(path, model, optimizer, step)`` after every step, kill
    rank 0 half-way through writing one checkpoint, relaunch with ``load_checkpoint(path, model, optimizer)`` (the
    step to run next) and check that the resumed run ends bitwise equal to one that never stopped."""
    source = "\n\n".join(function_source(fn, n) for fn, n in ((save_checkpoint, "save_checkpoint"),
                                                                (load_checkpoint, "load_checkpoint")))
    if is_stub(source, "save_checkpoint") or is_stub(source, "load_checkpoint"):
        return stub_verdict()
    ckpt = Path(tempfile.mkdtemp(prefix="exercise-resume-", dir=launch.runs_root()))
    hang = _("Every rank reaches the same barriers: call save_checkpoint on every rank and let only rank 0 write; "
             "a collective inside `if rank == 0` waits forever for the others.")
    outcomes, error = run_on_ranks("resume", source, "save_checkpoint", nproc, ["--ckpt", str(ckpt), "--phase", "crash"])
    savers = sorted(int(p.stem.removeprefix("saves-rank")) for p in ckpt.glob("saves-rank*.txt"))
    if any(rank != 0 for rank in savers):
        return Verdict(False, _("ranks {ranks} all wrote the checkpoint file.", ranks=", ".join(map(str, savers))),
                       _("Write it from rank 0 only (`if dist.get_rank() == 0:`): the replicas are identical, and "
                         "several processes writing one file at once can leave a mixture of their bytes."))
    if not (ckpt / KILLED).exists():
        problem = launch_problem(outcomes, error, hang, "save_checkpoint", source)
        if problem is not None:
            return problem
        return Verdict(False, _("the run was never killed: save_checkpoint wrote nothing with torch.save."),
                       _("Save with torch.save(a dict of the model's and the optimizer's state_dict() and the step, a path)."))
    outcomes, error = run_on_ranks("resume", source, "save_checkpoint", nproc, ["--ckpt", str(ckpt), "--phase", "resume"])
    problem = launch_problem(outcomes, error, hang, "save_checkpoint", source)
    if problem is not None:
        return problem
    o = outcomes[0]
    fault = o["fault_step"]
    if o["start"] != fault:
        return Verdict(False, _("the job was killed while saving step {fault}, so the last whole checkpoint is step "
                                "{last}; your load_checkpoint resumed at step {start}.", fault=fault, last=fault - 1,
                                start=o["start"]),
                       _("Return the step after the saved one: the saved step has already been trained."))
    if any(out["final"] != out["reference"] for out in outcomes.values()):
        return Verdict(False, _("the resumed run is not bitwise equal to a run that never stopped."),
                       _("Save and load everything training changes: the model's state_dict and the optimizer's "
                         "(Adam's moments and step count are part of the training state)."))
    return Verdict(True, _("rank 0 was killed half-way through saving step {fault}; the relaunch resumed at step "
                           "{fault} and ended bitwise equal to a run that never stopped, on {nproc} ranks.",
                           fault=fault, nproc=nproc))


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


def solution(name: str) -> str:
    """The reference solution of a write-the-code exercise, as source (shown only when asked for)."""
    from . import solutions
    fn = getattr(solutions, name, None)
    if fn is None:
        raise ValueError(f"no solution named {name!r}; there are: {', '.join(solutions.__all__)}")
    return inspect.getsource(fn)


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
    weights, and that a step sends at most 1.5x what DDP's all-reduce sends."""
    from ...calc import parity
    source = function_source(zero1_train, "zero1_train")
    if is_stub(source, "zero1_train"):
        return stub_verdict()
    outcomes, error = run_on_ranks("zero_shard", source, "zero1_train", nproc)
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
    return Verdict(True, _("on {nproc} ranks the weights after {steps} steps are DDP's (largest gap {gap:.1g} in "
                           "float32, within {k} x the rounding floor {floor:.1g} measured in the same run); each rank "
                           "keeps {state} bytes of AdamW state, {ratio:.2f} of the {whole} bytes a whole-model AdamW "
                           "keeps (about 1/{nproc}), and sends {sent:.2f} x DDP's bytes per step.",
                           nproc=nproc, steps=o["steps"], gap=gap32, k=PARITY_K, floor=floor,
                           state=d32["state_bytes"], ratio=d32["state_bytes"] / o["whole_state_bytes"],
                           whole=o["whole_state_bytes"], sent=sent / ddp))
