"""The exercises of the pipeline-parallel chapter (10): the 1F1B order of one stage's actions, written by hand and
compared with what torch's ``Schedule1F1B`` runs on 2 ranks, and the bubble fraction of a pipeline. Same shape as
:mod:`helpers.notebook.exercises.write`, which re-exports them (a notebook calls ``write.check_1f1b_order``).
"""
from __future__ import annotations

from ...calc import pipeline
from ..i18n import _
from . import Verdict, _never_raises
from .ranks import PREAMBLE, function_source, is_stub, launch_problem, run_on_ranks, stub_verdict

PREAMBLE.setdefault("one_f_one_b", "")  # a pure function of (stage, p, m): nothing to import
MICROBATCHES = "2,4"


def _gpipe(m: int) -> list[list]:
    return [["F", i] for i in range(m)] + [["B", i] for i in range(m)]


def _warm(order: list[list]) -> int:
    """Forwards before the first backward."""
    return next((i for i, (kind, _mb) in enumerate(order) if kind == "B"), len(order))


@_never_raises
def check_1f1b_order(one_f_one_b, nproc: int = 2) -> Verdict:
    """Run the learner's ``one_f_one_b(stage, p, m)`` on ``nproc`` ranks beside torch's Schedule1F1B (the order each
    stage executed, timed by helpers.rank.pipeline.StageClock) at 2 and 4 micro-batches; each classic mistake
    gets its hint."""
    source = function_source(one_f_one_b, "one_f_one_b")
    if is_stub(source, "one_f_one_b"):
        return stub_verdict()
    outcomes, error = run_on_ranks("pp_order", source, "one_f_one_b", nproc, args=["--microbatches", MICROBATCHES])
    problem = launch_problem(outcomes, error, _("one_f_one_b only returns a list: it must not call collectives."),
                             "one_f_one_b", source)
    if problem is not None:
        return problem
    for rank, o in sorted(outcomes.items()):
        if "returned" in o:
            return Verdict(False, _("one_f_one_b returned {kind}, not a list of (kind, micro-batch) pairs.",
                                    kind=o["returned"]),
                           _("Return a list such as [(\"F\", 0), (\"F\", 1), (\"B\", 0), ...]."))
        for case in o["cases"]:
            want, got, m = case["torch"], case["answer"], case["m"]
            if got == want:
                continue
            said = _("stage {stage} of {p}, {m} micro-batches: you run {got}, torch's Schedule1F1B ran {want}.",
                     stage=rank, p=nproc, m=m, got=" ".join(f"{k}{i}" for k, i in got),
                     want=" ".join(f"{k}{i}" for k, i in want))
            if sorted(map(tuple, got)) != sorted(map(tuple, want)):
                return Verdict(False, said, _("Every micro-batch needs exactly one forward and one backward on "
                                              "every stage: m of each."))
            if got == _gpipe(m) and m > nproc - rank:
                return Verdict(False, said, _("That is GPipe: every forward first, so the stage holds all m "
                                              "micro-batches' activations. 1F1B starts backwards early."))
            if _warm(got) != _warm(want):
                return Verdict(False, said, _("Warm-up: stage s runs p - 1 - s forwards (at most m) before its "
                                              "steady state, the last stage none; each steady pair is a forward "
                                              "followed by the backward of the oldest micro-batch held."))
            return Verdict(False, said, _("After the warm-up alternate one forward and one backward, oldest "
                                          "micro-batch first; then the remaining backwards in order."))
    return Verdict(True, _("on {nproc} ranks, at 2 and 4 micro-batches, every stage's order is the one torch's "
                           "Schedule1F1B ran.", nproc=nproc))


@_never_raises
def check_bubble(answer, *, p: int, m: int) -> Verdict:
    """The idle fraction of a GPipe or 1F1B step: (p - 1) / (m + p - 1), within 1%."""
    if isinstance(answer, bool) or not isinstance(answer, (int, float)):
        return Verdict(False, _("expected a fraction of a step (a number between 0 and 1), got {answer!r} "
                                "({answer_type}).", answer=answer, answer_type=type(answer).__name__),
                       _("Answer with a number such as 0.25."))
    right = pipeline.bubble_fraction(p, m)
    close = lambda value: abs(answer - value) <= 0.01 * max(value, 1e-9)  # noqa: E731
    if close(right):
        return Verdict(True, _("{answer:.3f}: (p - 1) / (m + p - 1) = {a} / {b}; 1F1B idles as much as GPipe.",
                               answer=answer, a=p - 1, b=m + p - 1))
    wrong = _("{answer:.3g} is not it.", answer=answer)
    if close((p - 1) / m):
        return Verdict(False, wrong, _("That is idle over busy time. The fraction is of the whole step: m + p - 1 "
                                       "slots, of which p - 1 idle."))
    if close(1 - right) or close(m / (m + p - 1)):
        return Verdict(False, wrong, _("That is the busy fraction; the bubble is the rest."))
    return Verdict(False, wrong, _("Each stage is busy m slots forward and m backward and waits p - 1 slots each "
                                   "way while the pipeline fills and drains."))
