"""The at-scale chapter's exercise (14): a layout for Llama 3 70B on 64 GPUs, judged by simulating it.

What the simulation of a layout's first and last stage measures is recorded from real runs of course/gpt_at_scale.py
(tests/recorded.py: the key hashes the script, every module it imports, the layout and torch's version) and replayed
here, so the catalogue of answers runs in the fast tier. One test marked slow simulates the reference and one wrong
answer for real."""
from __future__ import annotations

import numpy as np
import pytest

from helpers.notebook.exercises import write, write_scale
from helpers import launch
from recorded import source_digest, torch_version

SCRIPT = launch.PROJECT_ROOT / "course" / "gpt_at_scale.py"


@pytest.fixture
def replayed(monkeypatch, recorder):
    """check_layout with each simulation replayed from the store (recorded by `make record`)."""
    real = write_scale._measure

    def measure(model, lay, microbatches):
        label = f"{model} dp{lay['dp']} tp{lay['tp']} pp{lay['pp']} m{microbatches}"
        inputs = {"script": source_digest(SCRIPT), "layout": label, "torch": torch_version()}
        pairs = recorder.get("check_layout's simulation", label, inputs,
                             lambda: [[s, h] for s, h in real(model, lay, microbatches).items()])
        return {int(s): h for s, h in pairs}

    monkeypatch.setattr(write_scale, "_measure", measure)
    return write.check_layout


# A right answer in the forms a learner writes it: every one must pass, and say that it fits
RIGHT = [dict(dp=4, tp=8, pp=2), {"TP": 8, "PP": 2}, "dp 2 x tp 8 x pp 4", (4, 8, 2), dict(dp=4, tp=4, pp=4),
         dict(dp=1, tp=8, pp=8),
         dict(dp=np.int64(4), tp=8.0, pp=np.int32(2))]


@pytest.mark.parametrize("answer", RIGHT, ids=repr)
def test_a_layout_that_fits_passes_in_any_form(replayed, answer):
    verdict = replayed(answer)
    assert verdict.ok, str(verdict)
    assert "fits, as simulated" in str(verdict) and "The planner ranks" in str(verdict)


# Plausible wrong answers, each with the hint for its own mistake
WRONG = [
    (dict(dp=64, tp=1, pp=1), "does not fit", "Activations dominate"),         # FSDP alone: states shard, not these
    (dict(dp=16, tp=4, pp=1), "does not fit", "Activations dominate"),         # Megatron's SP count, not torch's
    (dict(dp=4, tp=2, pp=8), "does not fit", "micro-batches in flight"),       # more stages, more in flight
    (dict(dp=8, tp=8, pp=2), "= 128, but the job has 64", "product of the degrees"),
    (dict(dp=4, tp=16, pp=1), "spans 2 nodes", "inside one node"),
    (dict(dp=1, tp=2, pp=32), "cannot be split so", "pp the layers"),
    (dict(dp=8, tp=8, checkpoint="full"), "without recomputation", "Write the three degrees"),
    (dict(dp=None, tp=None, pp=None), "replace each None", "Write the three degrees"),
    ("eight by eight", "expected a layout", "Write the three degrees"),
    (dict(dp=0, tp=8, pp=8), "1 or more", "Write the three degrees"),
    (dict(dp=2.5, tp=8, pp=2), "whole number", "Write the three degrees"),
]


@pytest.mark.parametrize("answer, said, hint", WRONG, ids=lambda v: repr(v)[:40])
def test_a_wrong_layout_fails_with_the_hint_for_its_mistake(replayed, answer, said, hint):
    verdict = replayed(answer)
    assert not verdict.ok
    assert said in verdict.render("en") and hint in verdict.render("en"), verdict.render("en")


def test_the_simulations_own_failure_is_not_blamed_on_the_answer(monkeypatch):
    def broken(*args):
        raise RuntimeError("course/gpt_at_scale.py failed: Killed")

    monkeypatch.setattr(write_scale, "_measure", broken)
    verdict = write.check_layout(dict(dp=4, tp=8, pp=2))
    assert not verdict.ok and "simulation itself failed" in str(verdict) and "make setup" in str(verdict)


@pytest.mark.slow
def test_the_reference_fits_and_fsdp_alone_does_not_when_simulated_for_real():
    assert write.check_layout(dict(dp=4, tp=8, pp=2)).ok
    verdict = write.check_layout(dict(dp=16, tp=4, pp=1))
    assert not verdict.ok and "Activations dominate" in str(verdict)
