"""Notebook 10's exercises: the bubble fraction (an answer check), and the 1F1B order of one stage written by hand,
run on real gloo ranks against what torch's Schedule1F1B executes at two pipeline depths; the reference passes and
each classic mistake gets its own hint."""
import pytest

from helpers.calc import pipeline
from helpers.notebook.exercises import write, write_pp
from recorded import mistakes


def test_the_right_bubble_passes_and_each_slip_gets_its_hint():
    right = pipeline.bubble_fraction(4, 12)
    assert write.check_bubble(right, p=4, m=12) and write.check_bubble(0.2, p=4, m=12)
    for answer, hint in ((1 - right, "busy fraction"), (6 / 15, "idle slots twice"), (0.5, "fills and drains")):
        verdict = write.check_bubble(answer, p=4, m=12)
        assert not verdict and hint in verdict.hint, verdict
    for answer, hint in ((2 / 5, "idle over busy"), (3 / 8, "counts p slots")):  # at p = 3, m = 5 they differ
        verdict = write.check_bubble(answer, p=3, m=5)
        assert not verdict and hint in verdict.hint and "two different slips" not in verdict.hint, verdict
    assert not write.check_bubble("small", p=4, m=12) and not write.check_bubble(True, p=4, m=12)
    assert "expected a fraction" in write.check_bubble([0.2], p=4, m=12).message


def test_two_slips_that_give_the_same_number_are_both_named():
    """At notebook 10's p = 4, m = 12 (m = p(p - 1)) idle over busy, (p - 1) / m, and a fill of p slots, p / (m + p),
    are both 0.25: the hint names both, and a function answer is told which one it made."""
    assert 3 / 12 == 4 / 16
    verdict = write.check_bubble(0.25, p=4, m=12)
    assert not verdict and "two different slips" in verdict.hint and "idle over busy" in verdict.hint \
        and "counts p slots" in verdict.hint, verdict
    for slip, hint in ((lambda p, m: (p - 1) / m, "idle over busy"), (lambda p, m: p / (m + p), "counts p slots")):
        verdict = write.check_bubble(slip, p=4, m=12)
        assert not verdict and hint in verdict.hint and "two different slips" not in verdict.hint, verdict


def test_the_bubble_in_other_forms_passes():
    from fractions import Fraction

    import numpy as np
    import torch
    for answer in (Fraction(1, 5), torch.tensor(0.2), np.float64(0.2), np.array(0.2),
                   lambda p, m: (p - 1) / (m + p - 1), lambda p, m: Fraction(p - 1, m + p - 1)):
        verdict = write.check_bubble(answer, p=4, m=12)
        assert verdict, (answer, verdict)
    hard_coded = write.check_bubble(lambda p, m: 0.2, p=4, m=12)  # right at (4, 12) only
    assert not hard_coded and "bubble(3, 5)" in hard_coded.message, hard_coded
    assert "not a number" in write.check_bubble(lambda p, m: "0.2", p=4, m=12).message


def test_the_outline_is_answered_without_a_launch(monkeypatch):
    monkeypatch.setattr(write_pp, "run_on_ranks", lambda *a, **k: pytest.fail("launched an outline"))
    verdict = write.check_1f1b_order("def one_f_one_b(stage, p, m):\n    # warm-up, steady, cool-down\n    ...\n")
    assert not verdict and "nothing was launched" in verdict.message


SOLUTION = write.solution("one_f_one_b")
MISTAKES = {  # (text in the solution, what a learner writes instead, words of the hint)
    "GPipe's order": ("    warm = min(p - 1 - stage, m)", "    warm = m", "That is GPipe"),
    "a warm-up one too long": ("    warm = min(p - 1 - stage, m)", "    warm = min(p - stage, m)", "Warm-up"),
    "a micro-batch forgotten": ("for i in range(m - warm, m)]", "for i in range(m - warm, m - 1)]",
                                "exactly one forward and one backward"),
    "backward before forward in the steady state": ('order += [("F", i), ("B", i - warm)]',
                                                    'order += [("B", i - warm), ("F", i)]', "a forward followed by"),
    # bypass: right for the 2 stages a checker used to run, wrong for any other depth
    "written for 2 stages": ("    warm = min(p - 1 - stage, m)", "    warm = min(1 - stage, m)",
                             "right for a pipeline of 2 stages but not of 3"),
}


def test_the_reference_matches_torchs_order_for_every_stage_without_ranks():
    """The reference against the planned orders the lessons simulate (no launch): the plan's bubble is the formula."""
    solve = {}
    exec(SOLUTION, solve)
    for p, m in ((2, 2), (2, 4), (4, 4), (4, 8), (3, 5)):
        orders = {s: [(k, s, i) for k, i in solve["one_f_one_b"](s, p, m)] for s in range(p)}
        bubbles = pipeline.measured_bubble(pipeline.simulate(orders, p))
        assert all(b == pytest.approx(pipeline.bubble_fraction(p, m)) for b in bubbles.values())


@pytest.mark.slow
def test_the_reference_passes():
    verdict = write.check_1f1b_order(SOLUTION, nproc=2)
    assert verdict and "pipelines of 2 and 3 stages" in verdict.message, verdict


def test_the_reference_passes_from_three_stages(exercise_ranks):
    """Schedule1F1B wants m >= p: the micro-batch counts follow the depth (m = p and 2p), so nproc=3 can pass."""
    verdict = write.check_1f1b_order(SOLUTION, nproc=3)
    assert verdict and "pipelines of 3 and 4 stages" in verdict.message, verdict


@pytest.mark.parametrize("mistake", mistakes(MISTAKES, launched="GPipe's order"))
def test_each_1f1b_mistake_gets_its_hint(mistake, exercise_ranks):
    old, new, hint = MISTAKES[mistake]
    assert old in SOLUTION
    verdict = write.check_1f1b_order(SOLUTION.replace(old, new), nproc=2)
    assert not verdict and hint in verdict.hint, verdict
