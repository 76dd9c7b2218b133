"""Notebook 11's exercises: exposed communication from a step's intervals (an answer check), and the gradient sync
without overlap written by hand, run on real gloo ranks against DDP's gradients; the reference passes (each check
runs at 2 and 3 ranks) and each classic mistake gets its own hint."""
import pytest
import torch

from helpers.notebook.exercises import ranks, write, write_trace
from recorded import mistakes

SOLUTION = write.solution("average_gradients")
MISTAKES = {  # (text in the solution, what a learner writes instead, words of the hint)
    "the sum, not the mean": ("    flat /= dist.get_world_size()  # DDP averages\n", "", "Divide by"),
    "the result never copied back": ("        g.copy_(part.view_as(g))", "        pass", "copy the result back"),
    "one all-reduce per parameter": (
        "    flat = torch.cat([g.reshape(-1) for g in grads])  # one tensor: one all-reduce, one latency\n"
        "    dist.all_reduce(flat)  # the sum over the ranks, in place\n"
        "    flat /= dist.get_world_size()  # DDP averages\n"
        "    for g, part in zip(grads, flat.split([g.numel() for g in grads])):\n"
        "        g.copy_(part.view_as(g))\n",
        "    for g in grads:\n        dist.all_reduce(g)\n        g /= dist.get_world_size()\n", "Flatten them first"),
    "only rank 0 syncs": ("    dist.all_reduce(flat)  # the sum", "    if dist.get_rank() == 0:\n"
                          "        dist.all_reduce(flat)  # the sum", "an all_reduce on one rank waits for all"),
    # bypass: right on the 2 ranks a checker used to run, wrong on any other count
    "divided by 2, not the world size": ("    flat /= dist.get_world_size()  # DDP averages", "    flat /= 2",
                                         "On 2 ranks your gradients are DDP's, on 3 they are not"),
    "all_reduce_coalesced per parameter": (
        "    flat = torch.cat([g.reshape(-1) for g in grads])  # one tensor: one all-reduce, one latency\n"
        "    dist.all_reduce(flat)  # the sum over the ranks, in place\n"
        "    flat /= dist.get_world_size()  # DDP averages\n"
        "    for g, part in zip(grads, flat.split([g.numel() for g in grads])):\n"
        "        g.copy_(part.view_as(g))\n",
        "    dist.all_reduce_coalesced(grads)\n    for g in grads:\n        g /= dist.get_world_size()\n",
        "all_reduce it once"),
}


def test_the_outline_is_answered_without_a_launch(monkeypatch):
    monkeypatch.setattr(write_trace, "run_on_ranks", lambda *a, **k: pytest.fail("launched an outline"))
    verdict = write.check_grad_sync("def average_gradients(model):\n    # flatten\n    ...\n")
    assert not verdict and "nothing was launched" in verdict.message


@pytest.mark.slow
def test_the_reference_passes_on_two_and_three_ranks():
    verdict = write.check_grad_sync(SOLUTION)
    assert verdict and "on 2 and 3 ranks, one all-reduce" in verdict.message, verdict


def test_all_reduce_under_another_name_passes(exercise_ranks):
    """The all-reduces are counted at the process group: an alias of dist.all_reduce is the same call."""
    alias = SOLUTION.replace("    dist.all_reduce(flat)",
                             "    from torch.distributed import all_reduce as ar\n    ar(flat)")
    verdict = write.check_grad_sync(alias)
    assert verdict and "one all-reduce" in verdict.message, verdict


@pytest.mark.parametrize("mistake", mistakes(MISTAKES, launched="the sum, not the mean"))
def test_each_grad_sync_mistake_gets_its_hint(mistake, exercise_ranks, monkeypatch):
    monkeypatch.setattr(ranks, "STALL_S", 10)  # the hang case: the launcher's stall timeout, shortened
    old, new, hint = MISTAKES[mistake]
    assert old in SOLUTION
    verdict = write.check_grad_sync(SOLUTION.replace(old, new))
    assert not verdict and hint in verdict.hint, verdict


STEP = dict(compute=[(0, 42), (48, 70), (88, 95)], comm=[(30, 55), (60, 80)])  # notebook 11's exercise 2


def test_exposed_communication_by_hand_and_each_slip_gets_its_hint():
    assert write.check_exposed(16, **STEP) and write.check_exposed(16.1, **STEP)  # 42-48 and 70-80
    for answer, hint in ((45, "all of the communication"), (29, "hidden part"), (3, "one time axis")):
        verdict = write.check_exposed(answer, **STEP)
        assert not verdict and hint in verdict.hint, verdict
    assert "difference of totals" in write.check_exposed(30, compute=[(0, 40)], comm=[(20, 90)]).hint
    assert not write.check_exposed("16", **STEP) and not write.check_exposed(True, **STEP)
    from fractions import Fraction
    assert write.check_exposed(Fraction(16), **STEP) and write.check_exposed(torch.tensor(16.0), **STEP)


def test_the_chapter_does_not_show_the_answer_before_the_exercise():
    """Chapter 11 shows overlap.py's DDP lines in section 1, but not the body of its flat all-reduce: that is
    exercise 1's answer, and a learner who has just read it writes nothing."""
    from pathlib import Path

    import nbformat

    nb = nbformat.read(Path(__file__).resolve().parents[1] / "notebooks" / "11_inside_a_step.ipynb", 4)
    first = next(i for i, c in enumerate(nb.cells) if "exercise-write" in c.metadata.get("tags", []))
    assert "check_grad_sync" in nb.cells[first].source
    before = "\n".join(c.source + "".join(o.get("text", "") + str(o.get("data", {}).get("text/plain", ""))
                                          for o in c.get("outputs", []))
                       for c in nb.cells[:first] if c.cell_type == "code")
    assert "all_reduce_after_backward(model, world_size)" in before  # the call is shown, where DDP would sync
    for answer in ("torch.cat(", "dist.all_reduce(flat)", "flat /= world_size"):
        assert answer not in before, answer
