"""The exercises of the pipeline-parallel chapter (10): the 1F1B order of one stage's actions, written by hand and
compared with what torch's ``Schedule1F1B`` runs on pipelines of two depths, and the bubble fraction of a pipeline
(a number, or a function of p and m). Same shape as
:mod:`helpers.notebook.exercises.write`, which re-exports them (a notebook calls ``write.check_1f1b_order``).
"""
from __future__ import annotations

from ...calc import pipeline
from ..i18n import _
from . import Verdict, _never_raises, _real_number
from .ranks import PREAMBLE, function_source, is_stub, launch_problem, run_on_ranks, stub_verdict

PREAMBLE.setdefault("one_f_one_b", "")  # a pure function of (stage, p, m): nothing to import


def _gpipe(m: int) -> list[list]:
    return [["F", i] for i in range(m)] + [["B", i] for i in range(m)]


def _warm(order: list[list]) -> int:
    """Forwards before the first backward."""
    return next((i for i, (kind, _mb) in enumerate(order) if kind == "B"), len(order))


@_never_raises
def check_1f1b_order(one_f_one_b, nproc: int = 2) -> Verdict:
    """Run the learner's ``one_f_one_b(stage, p, m)`` on ``nproc + 1`` ranks beside torch's Schedule1F1B (the order
    each stage executed, timed by helpers.rank.pipeline.StageClock) on pipelines of ``nproc`` and ``nproc + 1``
    stages, each at m = p and 2p micro-batches (Schedule1F1B wants m >= p): an order written for one pipeline depth
    only is wrong at the other. Each classic mistake gets its hint."""
    source = function_source(one_f_one_b, "one_f_one_b")
    if is_stub(source, "one_f_one_b"):
        return stub_verdict()
    outcomes, error = run_on_ranks("pp_order", source, "one_f_one_b", nproc + 1)
    problem = launch_problem(outcomes, error, _("one_f_one_b only returns a list: it must not call collectives."),
                             "one_f_one_b", source)
    if problem is not None:
        return problem
    for rank, o in sorted(outcomes.items()):
        if "returned" in o:
            return Verdict(False, _("one_f_one_b returned {kind}, not a list of (kind, micro-batch) pairs.",
                                    kind=o["returned"]),
                           _("Return a list such as [(\"F\", 0), (\"F\", 1), (\"B\", 0), ...]."))
    cases = sorted(((c["p"], c["m"], rank, c) for rank, o in outcomes.items() for c in o["cases"]),
                   key=lambda item: item[:3])
    depths = sorted({p for p, _m, _rank, _c in cases})
    right_at = [p for p in depths if all(c["answer"] == c["torch"] for q, _m, _r, c in cases if q == p)]
    for p, m, rank, case in cases:
        want, got = case["torch"], case["answer"]
        if got == want:
            continue
        said = _("stage {stage} of {p}, {m} micro-batches: you run {got}, torch's Schedule1F1B ran {want}.",
                 stage=rank, p=p, m=m, got=" ".join(f"{k}{i}" for k, i in got),
                 want=" ".join(f"{k}{i}" for k, i in want))
        if sorted(map(tuple, got)) != sorted(map(tuple, want)):
            return Verdict(False, said, _("Every micro-batch needs exactly one forward and one backward on "
                                          "every stage: m of each."))
        gpipe = all(c["answer"] == _gpipe(c["m"]) for q, _m, r, c in cases if (q, r) == (p, rank))
        if gpipe and m > p - rank:  # GPipe at every m, not an order that happens to match it at one
            return Verdict(False, said, _("That is GPipe: every forward first, so the stage holds all m "
                                          "micro-batches' activations. 1F1B starts backwards early."))
        if right_at:
            return Verdict(False, said, _("Your orders are right for a pipeline of {right} stages but not of {p}: "
                                          "write them in terms of p and stage, not for one depth. Stage s of p runs "
                                          "p - 1 - s warm-up forwards.", right=right_at[0], p=p))
        if _warm(got) != _warm(want):
            return Verdict(False, said, _("Warm-up: stage s runs p - 1 - s forwards (at most m) before its "
                                          "steady state, the last stage none; each steady pair is a forward "
                                          "followed by the backward of the oldest micro-batch held."))
        return Verdict(False, said, _("After the warm-up alternate one forward and one backward, oldest "
                                      "micro-batch first; then the remaining backwards in order."))
    return Verdict(True, _("on pipelines of {depths} stages, at m = p and m = 2p micro-batches, every stage's order "
                           "is the one torch's Schedule1F1B ran.", depths=" and ".join(map(str, depths))))


# (p, m) pairs where the classic slips all give different values; a function answer is checked at each
BUBBLE_PAIRS = ((3, 5), (2, 3), (8, 4))


def _bubble_slips(p: int, m: int) -> list[tuple[float, str]]:
    """(value, hint) of each classic wrong bubble at (p, m)."""
    return [((p - 1) / m, _("That is idle over busy time. The fraction is of the whole step: m + p - 1 slots, of which "
                            "p - 1 idle.")),
            (p / (m + p), _("That counts p slots to fill the pipeline; it takes p - 1: the first micro-batch reaches "
                            "the last stage after p - 1 steps. The fraction is (p - 1) of m + p - 1 slots.")),
            (m / (m + p - 1), _("That is the busy fraction; the bubble is the rest.")),
            (2 * (p - 1) / (m + p - 1), _("That counts the idle slots twice. Forward and backward each take m + p "
                                          "- 1 slots, p - 1 of them idle: the fraction is the same for both."))]


def _bubble_verdict(value: float, p: int, m: int, wrong) -> Verdict:
    right = pipeline.bubble_fraction(p, m)
    close = lambda v: abs(value - v) <= 0.01 * max(v, 1e-9)  # noqa: E731
    if close(right):
        return Verdict(True, "")
    hints = [hint for v, hint in _bubble_slips(p, m) if close(v)]
    if len(hints) == 1:
        return Verdict(False, wrong, hints[0])
    if len(hints) > 1:  # at this (p, m) two slips give the same number: name both
        return Verdict(False, wrong, _("At p = {p}, m = {m} two different slips give this number. (1) {first} "
                                       "(2) {second} To be told which is yours, pass a function bubble(p, m) "
                                       "instead of the number.", p=p, m=m, first=hints[0], second=hints[1]))
    return Verdict(False, wrong, _("Each stage is busy m slots forward and m backward and waits p - 1 slots each "
                                   "way while the pipeline fills and drains."))


@_never_raises
def check_bubble(answer, *, p: int, m: int) -> Verdict:
    """The idle fraction of a GPipe or 1F1B step: (p - 1) / (m + p - 1), within 1%. ``answer`` is a number for this
    (p, m), or a function ``bubble(p, m)``, checked at (p, m) and at :data:`BUBBLE_PAIRS`, where the classic slips
    differ (at p = 4, m = 12 idle-over-busy (p - 1) / m and a p-slot fill p / (m + p) are both 0.25)."""
    if callable(answer):
        # the pairs where every slip differs first, so that a wrong function is told its one slip
        for pp, mm in (*((q, n) for q, n in BUBBLE_PAIRS if (q, n) != (p, m)), (p, m)):
            got = answer(pp, mm)
            value = _real_number(got)
            if value is None:
                return Verdict(False, _("bubble({p}, {m}) returned {answer!r}, not a number.", p=pp, m=mm, answer=got),
                               _("Return the fraction as a number, such as (p - 1) / (m + p - 1) computed from p "
                                 "and m."))
            verdict = _bubble_verdict(value, pp, mm, _("bubble({p}, {m}) = {answer:.3g} is not it.", p=pp, m=mm,
                                                       answer=value))
            if not verdict:
                return verdict
        return Verdict(True, _("bubble(p, m) is (p - 1) / (m + p - 1) at p = {p}, m = {m} ({answer:.3f}) and at "
                               "{others} more pairs; 1F1B idles as much as GPipe.", p=p, m=m,
                               answer=pipeline.bubble_fraction(p, m), others=len(BUBBLE_PAIRS)))
    value = _real_number(answer)
    if value is None:
        return Verdict(False, _("expected a fraction of a step (a number between 0 and 1), got {answer!r} "
                                "({answer_type}).", answer=answer, answer_type=type(answer).__name__),
                       _("Answer with a number such as 0.25."))
    verdict = _bubble_verdict(value, p, m, _("{answer:.3g} is not it.", answer=value))
    if verdict:
        return Verdict(True, _("{answer:.3f}: (p - 1) / (m + p - 1) = {a} / {b}; 1F1B idles as much as GPipe.",
                               answer=value, a=p - 1, b=m + p - 1))
    return verdict
