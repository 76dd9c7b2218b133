"""The exercises on traces: chapter 11's gradient sync without overlap written by hand (one all-reduce after the
backward, checked on real ranks against DDP), and chapter 06's hung run read from its Flight Recorder dumps (which
rank stopped, in which collective). Same shape as :mod:`helpers.notebook.exercises.write_pp`; :mod:`.write` re-exports both.

Example::

    from helpers.notebook.exercises import write
    write.check_grad_sync(average_gradients)            # launches it on 2 gloo ranks
    write.check_exposed(35, compute=[(0, 60)], comm=[(25, 95)])
    write.check_diagnosis(1, "all_reduce", missing)     # missing: the run of --scenario missing
    # Correct: rank 1 never called all_reduce #4; the other ranks waited in it until their timeout.
"""
from __future__ import annotations

import re

from ...calc import parity
from ...calc import traces as calc
from ..i18n import _
from . import Verdict, _never_raises, _real_number, _whole_number
from .ranks import (PARITY_K, PREAMBLE, by_world, function_source, is_stub, launch_problem, run_on_ranks,
                    stub_verdict)

PREAMBLE.setdefault("average_gradients", "import torch\nimport torch.distributed as dist\n")

_NAMESPACES = re.compile(r"^(torch\.distributed\.|dist\.|gloo:|nccl:)")


def _op_name(answer) -> str | None:
    """A collective's name as the Flight Recorder writes it, from what a learner may type: "all_reduce",
    "allreduce", "dist.all_reduce()", "gloo:all_reduce", "ALLREDUCE" -> "allreduce" (None: not a name)."""
    if not isinstance(answer, str) or not answer.strip():
        return None
    name = _NAMESPACES.sub("", answer.strip().lower())
    return re.sub(r"[\s_\-]|\(\)$", "", name) or None


@_never_raises
def check_exposed(answer, *, compute: list, comm: list) -> Verdict:
    """Milliseconds of one step's communication that no compute covered, from its compute and communication
    intervals (``[(start, end), ...]`` in ms): :func:`helpers.calc.traces.minus` of their unions, within 1%."""
    value = _real_number(answer)
    if value is None:
        return Verdict(False, _("expected milliseconds (a number), got {answer!r} ({answer_type}).", answer=answer,
                                answer_type=type(answer).__name__), _("Answer with a number such as 12.5."))
    answer = value  # a Fraction, a numpy scalar or a 0-d tensor, read as a number
    busy, talk = calc.union(map(tuple, compute)), calc.union(map(tuple, comm))
    right = calc.length(calc.minus(talk, busy))
    close = lambda value: abs(answer - value) <= 0.01 * max(value, 1e-9)  # noqa: E731
    if close(right):
        return Verdict(True, _("{answer:g} ms of the {total:g} ms of communication ran while nothing computed; "
                               "compute hid the other {hidden:g} ms.", answer=answer, total=calc.length(talk),
                               hidden=calc.length(talk) - right))
    wrong = _("{answer:g} ms is not it.", answer=answer)
    if close(calc.length(talk)):
        return Verdict(False, wrong, _("That is all of the communication. Take away the parts during which compute "
                                       "ran too."))
    if close(calc.length(talk) - right):
        return Verdict(False, wrong, _("That is the hidden part: the communication compute covered. Exposed is the "
                                       "rest."))
    if close(sum(b - a for a, b in comm) - sum(b - a for a, b in compute)):
        return Verdict(False, wrong, _("Overlap is not a difference of totals: compare the intervals, a piece of "
                                       "communication is exposed only where no compute interval covers it."))
    return Verdict(False, wrong, _("Draw both on one time axis: exposed is where an all-reduce is in flight and no "
                                   "compute interval covers that moment."))


def _gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b)) if len(a) == len(b) and a else float("inf")


@_never_raises
def check_grad_sync(average_gradients, nproc: int = 2) -> Verdict:
    """Run the learner's ``average_gradients(model)`` after a backward without DDP on ``nproc + 1`` ranks, then on
    ``nproc`` (a new process group without the last rank: an answer that hard-codes the rank count is wrong at one
    of them), and compare every gradient with DDP's from the same weights and batches, within :data:`PARITY_K` x the
    gap between DDP's float32 and float64 gradients; then count the all-reduces at the process group (one is the
    point: no overlap, one message)."""
    source = function_source(average_gradients, "average_gradients")
    if is_stub(source, "average_gradients"):
        return stub_verdict()
    outcomes, error = run_on_ranks("grad_sync", source, "average_gradients", nproc + 1)
    problem = launch_problem(outcomes, error, _("Every rank must call the same collectives in the same order: an "
                                                 "all_reduce on one rank waits for all the others."),
                             "average_gradients", source)
    if problem is not None:
        return problem
    runs = by_world(outcomes)
    verdicts = {world: _grad_sync_verdict(runs[world], world) for world in sorted(runs)}
    right = [world for world, v in verdicts.items() if v is None]
    for world, verdict in verdicts.items():
        if verdict is None:
            continue
        if right and verdict.hint == _FIXED_COUNT_HINT:
            return Verdict(False, verdict.message, _("On {right} ranks your gradients are DDP's, on {world} they are "
                                                     "not: the division must follow the run. Divide by "
                                                     "dist.get_world_size(), not by a fixed number.",
                                                     right=right[0], world=world))
        return verdict
    gap = max(_gap(o["answer"], o["fp32"]) for world in runs for o in runs[world].values())
    return Verdict(True, _("on {small} and {large} ranks, one all-reduce of {elements} values gives DDP's gradients "
                           "(largest gap {gap:.1g}, within {k} x the fp32-vs-fp64 floor).", small=min(runs),
                           large=max(runs), elements=runs[min(runs)][0]["all_reduce_elements"][0], gap=gap,
                           k=PARITY_K))


_FIXED_COUNT_HINT = _("all_reduce adds; DDP averages. Divide by dist.get_world_size(), the number of ranks of this "
                      "run, not by a fixed number.")


def _grad_sync_verdict(outcomes: dict[int, dict], nproc: int) -> Verdict | None:
    """What is wrong with one run of ``nproc`` ranks (None: nothing)."""
    tolerance = {r: PARITY_K * parity.floor(o["fp32"], o["fp64"]) for r, o in outcomes.items()}
    wrong = [r for r, o in outcomes.items() if _gap(o["answer"], o["fp32"]) > tolerance[r]]
    if wrong:
        o = outcomes[wrong[0]]
        if _gap(o["answer"], o["local"]) == 0:
            return Verdict(False, _("the gradients after average_gradients are still this rank's own."),
                           _("dist.all_reduce works in place on the tensor you pass: if it is a new tensor (torch.cat "
                             "makes one), copy the result back into each p.grad."))
        if _gap([v / nproc for v in o["answer"]], o["fp32"]) <= tolerance[wrong[0]]:
            return Verdict(False, _("the gradients are {nproc} x DDP's: the sum over the ranks, not the mean.",
                                    nproc=nproc),
                           _("all_reduce adds; DDP averages. Divide by dist.get_world_size()."))
        ratio = _ratio(o["answer"], o["fp32"])
        if ratio is not None and all(_gap([v / ratio for v in out["answer"]], out["fp32"]) <= tolerance[r]
                                     for r, out in outcomes.items()):
            return Verdict(False, _("on {nproc} ranks the gradients are {ratio:.3g} x DDP's: the sum divided by "
                                    "{divisor:.3g}, not by {nproc}.", nproc=nproc, ratio=ratio,
                                    divisor=nproc / ratio), _FIXED_COUNT_HINT)
        return Verdict(False, _("the gradients differ from DDP's (on ranks {ranks}).", ranks=wrong),
                       _("Every rank must end with the mean over the ranks of each parameter's gradient, in that "
                         "parameter's p.grad."))
    first = outcomes[min(outcomes)]
    others = [name for name in first.get("collectives", ["all_reduce"]) if name != "all_reduce"]
    if others:
        return Verdict(False, _("the gradients are right, made with {names}; the exercise asks for one all_reduce.",
                                names=", ".join(["all_reduce"] * bool(first["all_reduce_calls"]) + others)),
                       _("Flatten the gradients into one tensor, all_reduce it once, divide, and copy each slice "
                         "back: one message, one latency."))
    calls = first["all_reduce_calls"]
    if calls != 1:
        return Verdict(False, _("the gradients are right, with {calls} all-reduces per step; the exercise asks for "
                                "one.", calls=calls),
                       _("One message per parameter pays the latency {calls} times. Flatten them first: "
                         "flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()]), one all_reduce, then "
                         "copy each slice back.", calls=calls))
    return None


def _ratio(answer: list[float], reference: list[float]) -> float | None:
    """answer / reference, read off the largest reference value (None: no usable element, or a ratio of 1)."""
    i = max(range(len(reference)), key=lambda k: abs(reference[k]), default=None)
    if i is None or len(answer) != len(reference) or reference[i] == 0:
        return None
    ratio = answer[i] / reference[i]
    return None if ratio == 0 or abs(ratio - 1) < 1e-6 else ratio


@_never_raises
def check_diagnosis(rank, op, run) -> Verdict:
    """Which rank stopped, and in which collective, in ``run`` (a run of ``course/pitfall_desync.py``: the Run or
    the LaunchError its launch raised), compared with what its Flight Recorder dumps say
    (:func:`helpers.notebook.lessons.flight.stuck`). For a rank that never reached the collective (``--scenario
    missing``), ``op`` is the collective the other ranks waited in.

    Example::

        >>> check_diagnosis(1, "all_reduce", missing)
        Correct: rank 1 never called all_reduce #4; the other ranks waited in it until their timeout.
    """
    from ..lessons import flight

    if not flight.dumps(run):
        return Verdict(False, _("this run left no Flight Recorder dumps."),
                       _("Pass the run of course/pitfall_desync.py (or the error its launch raised)."))
    found = flight.stuck(run)
    if found is None:
        return Verdict(False, _("this run's Flight Recorder dumps show every rank calling the same collectives."),
                       _("Check the run you pass: the one of the faulty scenario, which ended in a timeout."))
    value = _whole_number(rank)
    if value is None:
        return Verdict(False, _("expected a rank (a whole number), got {answer!r} ({answer_type}).",
                                answer=rank, answer_type=type(rank).__name__),
                       _("Answer with the rank as a number, such as 0, and the collective as a string."))
    name = _op_name(op)
    if name is None:
        return Verdict(False, _("expected the collective's name as a string, got {answer!r}.", answer=op),
                       _("Name it as the analysis does, such as \"broadcast\"."))
    nproc = len(flight.dumps(run))
    right_op = found["op"] or found["expected"]
    if value != found["rank"]:
        wrong = _("rank {value} is not the one that stopped.", value=value)
        if not 0 <= value < nproc:
            return Verdict(False, wrong, _("This run has ranks 0 to {last}.", last=nproc - 1))
        if found["op"] is None:
            return Verdict(False, wrong, _("The rank that is behind is the one whose last entry has the lowest "
                                           "sequence number: the others wait for it in a collective it never "
                                           "called. The analysis lists it under \"missing ranks\"."))
        return Verdict(False, wrong, _("Find the first sequence number at which the ranks' entries differ: most "
                                       "ranks called one collective there, one rank another. The analysis calls "
                                       "that one the culprit."))
    if name != _op_name(right_op):
        wrong = _("right rank, but {op} is not the collective.", op=op)
        if found["op"] is None:
            return Verdict(False, wrong, _("Rank {rank} called nothing at that sequence number: name the collective "
                                           "the other ranks waited in there (the analysis's \"collective:\" line).",
                                           rank=found["rank"]))
        if name == _op_name(found["expected"]):
            return Verdict(False, wrong, _("That is what the other ranks called at that sequence number. Which "
                                           "collective did rank {rank} call there?", rank=found["rank"]))
        return Verdict(False, wrong, _("Read the entry of rank {rank} at the first sequence number where the ranks "
                                       "differ (the analysis's error message names both collectives).",
                                       rank=found["rank"]))
    if found["op"] is None:
        return Verdict(True, _("rank {rank} never called {op} #{seq}; the other ranks waited in it until their "
                               "timeout.", rank=found["rank"], op=right_op, seq=found["seq"]))
    return Verdict(True, _("rank {rank} called {op} #{seq} where the other ranks called {expected}; each side waited "
                           "for the other until the timeout.", rank=found["rank"], op=right_op, seq=found["seq"],
                           expected=found["expected"]))
