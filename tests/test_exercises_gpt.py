"""Notebook 08's exercises: the layer-bytes answer check, and checkpointing written by hand on 2 DDP gloo ranks
(the reference passes, each classic mistake gets its hint). Launching tests are slow."""
import pytest

from helpers.calc import activations
from helpers.notebook.exercises import solutions, write

SHAPE = dict(s=128, b=4, h=256, a=8)


def test_the_formula_answer_passes_and_the_classic_wrong_ones_get_their_hint():
    s, b, h, a = SHAPE.values()
    assert write.check_layer_bytes(activations.layer_bytes(s, b, h, a), **SHAPE)
    assert write.check_layer_bytes(4 * (16 * s * b * h + a * s * s * b), **SHAPE)
    korthikanti = write.check_layer_bytes(34 * s * b * h + 5 * a * s * s * b, **SHAPE)
    assert not korthikanti and "dropout" in korthikanti.hint
    elements = write.check_layer_bytes(16 * s * b * h + a * s * s * b, **SHAPE)
    assert not elements and "bytes of an element" in elements.hint
    assert "softmax" in write.check_layer_bytes(4 * 16 * s * b * h, **SHAPE).hint
    one_head = write.check_layer_bytes(4 * (16 * s * b * h + s * s * b), **SHAPE)
    assert not one_head and "one s x s matrix per head" in one_head.hint, one_head
    half = write.check_layer_bytes(2 * (16 * s * b * h + a * s * s * b), **SHAPE)
    assert not half and "2 bytes an element" in half.hint, half
    assert not write.check_layer_bytes("many", **SHAPE)


def test_an_outline_is_answered_without_a_launch(monkeypatch):
    import helpers.notebook.exercises.write_gpt as write_gpt
    monkeypatch.setattr(write_gpt, "run_on_ranks", lambda *a, **k: pytest.fail("launched an outline"))
    assert "outline" in write.check_checkpointing("def run_blocks(blocks, x):\n    ...\n").message


@pytest.mark.slow
def test_the_reference_solution_passes_on_two_ranks():
    verdict = write.check_checkpointing(solutions.run_blocks)
    assert verdict, verdict


@pytest.mark.parametrize("body, needle", [
    pytest.param("for block in blocks:\n        checkpoint(block, x, use_reentrant=False)\n    return x", "assign it",
                 marks=pytest.mark.slow),
    ("for block in blocks:\n        x = checkpoint(block, x, use_reentrant=True)\n    return x", "use_reentrant=False"),
    ("for block in blocks:\n        x = block(x)\n    return x", "Wrap each block"),
    ("def all_of_them(x):\n        for block in blocks:\n            x = block(x)\n        return x\n"
     "    return checkpoint(all_of_them, x, use_reentrant=False)", "One checkpoint per block"),
])
def test_each_classic_mistake_gets_its_hint(body, needle, exercise_ranks):
    verdict = write.check_checkpointing("def run_blocks(blocks, x):\n    " + body + "\n")
    assert not verdict and needle in verdict.hint, verdict
