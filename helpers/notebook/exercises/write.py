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
from .. import i18n
from ..i18n import _
from . import Verdict, _never_raises
from .ranks import (PARITY_K, by_world, close, function_source, is_stub, launch_problem, one_count_hint,
                    parity_bound, run_on_ranks, stub_verdict)
# the ZeRO chapters' checkers (03, 04) live in write_zero.py; notebooks call them through this module
from .write_zero import (DS_ACCUMULATION, DS_ARGS, DS_MICRO, DS_PARAMS, check_ds_config, check_zero1,  # noqa: F401
                         ds_budget_bytes)
from .write_gpt import check_checkpointing, check_layer_bytes  # noqa: F401  (notebook 08)
from .write_tp import check_tp_bytes, check_tp_linears  # noqa: F401  (notebook 09)
from .write_cp import check_ring_bytes, check_ring_step  # noqa: F401  (notebook 12)
from .write_moe import check_dispatch, check_dispatch_bytes  # noqa: F401  (notebook 13)
from .write_scale import check_layout, check_state_bytes  # noqa: F401  (notebook 14)
from .write_pp import check_1f1b_order, check_bubble  # noqa: F401  (notebook 10)
from .write_trace import check_diagnosis, check_exposed, check_grad_sync  # noqa: F401  (notebooks 06, 11)

@_never_raises
def check_ring_all_reduce(ring_all_reduce, nproc: int = 3) -> Verdict:
    """Run the learner's ``ring_all_reduce(tensor)`` (sum in place, from send/recv only) on ``nproc`` ranks, then on
    ``nproc - 1`` where that is more than 1 (a ring written for one rank count fails the other), for a
    tensor that splits evenly, one that does not, and one shorter than the number of ranks; check the sums, that
    no built-in collective ran (counted at the process group, whatever name reached it: an alias, an object
    collective, a functional collective) and that the ranks together sent, point-to-point (dist.send, dist.isend,
    dist.batch_isend_irecv), 2(N-1) times the tensor, as the ring does: no more, and no less."""
    source = function_source(ring_all_reduce, "ring_all_reduce")
    if is_stub(source, "ring_all_reduce"):
        return stub_verdict()
    outcomes, error = run_on_ranks("ring", source, "ring_all_reduce", nproc)
    problem = launch_problem(outcomes, error, _(
        "A blocking dist.send returns only once the message is on its way; if every rank sends a large chunk "
        "before any rank receives, all of them wait. Post the receive too: dist.isend + dist.irecv, then wait on "
        "both."), "ring_all_reduce", source, right_run=lambda run: all(c["correct"] for c in run["cases"]))
    if problem is not None:
        return problem
    runs = by_world(outcomes)
    verdicts = {world: _ring_verdict(runs[world], world) for world in sorted(runs, reverse=True)}
    right = [world for world, v in verdicts.items() if v.ok]
    for world, verdict in verdicts.items():
        sums_wrong = not all(c["correct"] for o in runs[world].values() for c in o["cases"])
        if not verdict.ok and right and sums_wrong:  # right sums at the other rank count: written for one count
            return Verdict(False, verdict.message, one_count_hint(right[0], world))
        if not verdict.ok:  # (sent bytes can match a ring's at 2 ranks by chance: that is no rank-count slip)
            return verdict
    if len(runs) == 1:
        return verdicts[nproc]
    o = runs[nproc]
    per_rank = sum(o[r]["cases"][0]["sent_bytes"] for r in o) / nproc / o[0]["cases"][0]["bytes"]
    return Verdict(True, _("on {nproc} and {fewer} ranks every rank holds the sum for {n_cases} tensor sizes, from "
                           "point-to-point messages alone; on {nproc}, each rank sent {per_rank:.3f} x the tensor, "
                           "which is 2(N-1)/N = {formula:.3f}.", nproc=nproc, fewer=min(runs),
                           n_cases=len(o[0]["cases"]), per_rank=per_rank, formula=2 * (nproc - 1) / nproc))


def _ring_verdict(outcomes: dict[int, dict], nproc: int) -> Verdict:
    """The verdict on one run of ``nproc`` ranks."""
    point_to_point = _("Build it from point-to-point messages only: dist.send/dist.recv or dist.isend/dist.irecv "
                       "to the next and from the previous rank in the ring.")
    used = sorted({name for o in outcomes.values() for name in o["built_ins"]})
    if used:  # counted at the process group: under any name, an object collective, a functional collective
        from ...rank.exercises.traffic import UNSEEN
        names = [_("a functional collective, below torch.distributed's Python functions") if name == UNSEEN
                 else name for name in used]
        return Verdict(False, _("your function ran a built-in collective ({names}), which does the work for you.",
                                names=i18n.join(names)), point_to_point)
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
    if any(s < t for s, t in zip(sent_total, ring_total)):  # each chunk goes round the ring twice: no less will do
        i = next(i for i in range(n_cases) if sent_total[i] < ring_total[i])
        return Verdict(False, _("the sums are right, but the ranks sent only {sent} bytes point-to-point for a "
                                "{size}-byte tensor; the ring sends 2(N-1) x {size} = {ring}, so something else "
                                "carried the data.", sent=sent_total[i], size=outcomes[0]["cases"][i]["bytes"],
                                ring=ring_total[i]), point_to_point)
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
    launch.runs_root().mkdir(parents=True, exist_ok=True)       # a fresh clone has no runs/ until something launches
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


def solution(name: str) -> str:
    """The reference solution of a write-the-code exercise, as source (shown only when asked for)."""
    from . import solutions
    fn = getattr(solutions, name, None)
    if fn is None:
        raise ValueError(f"no solution named {name!r}; there are: {', '.join(solutions.__all__)}")
    return inspect.getsource(fn)
