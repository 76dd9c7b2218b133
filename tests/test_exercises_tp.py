"""Notebook 09's exercises: the bytes TP sends (an answer check), and Megatron's f and g written by hand, run on
real gloo ranks against two nn.Linear; the reference passes and each classic mistake gets its own hint."""
import pytest

from helpers.calc import tp
from helpers.notebook.exercises import write, write_tp
from recorded import mistakes

SIZE = dict(n_layer=2, batch=8, seq_len=1024, d_model=4096, tp_degree=8, bytes_per_element=2)
RIGHT = tp.activation_bytes_per_step(2, 8, 1024, 4096, 8, False, 2)


def test_the_right_byte_count_passes_and_each_slip_gets_its_hint():
    assert write.check_tp_bytes(RIGHT, **SIZE)
    assert write.check_tp_bytes(RIGHT * 1.005, **SIZE)  # within 1%
    for answer, hint in ((RIGHT / 2, "forward pass only"), (RIGHT / 2 * 8 / 7, "2 (N-1)/N"),
                         (RIGHT * 0.7, "Per layer: 2 regions")):
        verdict = write.check_tp_bytes(answer, **SIZE)
        assert not verdict and hint in verdict.hint, verdict
    three = tp.activation_bytes_per_step(3, 8, 1024, 4096, 8, False, 2)
    verdict = write.check_tp_bytes(three / 3, **{**SIZE, "n_layer": 3})
    assert not verdict and "one layer" in verdict.hint, verdict
    assert not write.check_tp_bytes("a lot", **SIZE) and not write.check_tp_bytes(True, **SIZE)


def test_the_outline_is_answered_without_a_launch(monkeypatch):
    monkeypatch.setattr(write_tp, "run_on_ranks", lambda *a, **k: pytest.fail("launched an outline"))
    stub = "def column_row_linears(x, w1, w2):\n    # rank, world = ...\n    ...\n"
    verdict = write.check_tp_linears(stub)
    assert not verdict and "nothing was launched" in verdict.message


SOLUTION = write.solution("column_row_linears")
MISTAKES = {  # (text in the solution, what a learner writes instead, words of the hint)
    "no all-reduce in f's backward": ("            dist.all_reduce(grad)  # each", "            # each",
                                      "f's backward must all-reduce"),
    "all-reduce in both directions": ("            return grad  # the gradient of y",
                                      "            grad = grad.clone()\n            dist.all_reduce(grad)\n"
                                      "            return grad  #", "all-reduce in both directions"),
    "the wrong dimension sharded": ("tensor_split(w1, world, 0)", "tensor_split(w1, world, 1)", "OUTPUT features"),
    "no all-reduce in g's forward": ("            dist.all_reduce(total)  # the row", "            # the row",
                                     "g's forward must all-reduce"),
    "one weight sharded, the other whole": ("torch.tensor_split(w1, world, 0)[rank].clone()", "w1.clone()",
                                            "OUTPUT features"),
}


def test_whole_weights_are_named_as_unsharded(exercise_ranks):
    whole = SOLUTION.replace("torch.tensor_split(w1, world, 0)[rank].clone()", "w1.clone()").replace(
        "torch.tensor_split(w2, world, 1)[rank].clone()", "w2.clone()")
    verdict = write.check_tp_linears(whole, nproc=2)
    assert not verdict and "1/N of w1's rows" in verdict.hint, verdict


@pytest.mark.slow
def test_the_reference_passes():
    verdict = write.check_tp_linears(SOLUTION, nproc=2)
    assert verdict, verdict


@pytest.mark.parametrize("mistake", mistakes(MISTAKES, launched="no all-reduce in g's forward"))
def test_each_tp_mistake_gets_its_hint(mistake, exercise_ranks):
    old, new, hint = MISTAKES[mistake]
    assert old in SOLUTION
    verdict = write.check_tp_linears(SOLUTION.replace(old, new), nproc=2)
    assert not verdict and hint in verdict.hint, verdict
