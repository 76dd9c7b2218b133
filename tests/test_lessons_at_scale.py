"""Notebook 14's lesson logic on made-up simulation results: each claim prints False when a rank strays from the
formula or a verdict reverses, the busiest moment adds what the simulated step leaves out, and a layout that cannot
be built is refused before any process starts. (The simulations themselves run in the notebook, under nbval, and in
tests/test_at_scale.py.)"""
from __future__ import annotations

import pytest

from helpers.calc import scale
from helpers.notebook import checks
from helpers.notebook.lessons import at_scale as lesson

GIB = 2 ** 30


def result(stage=0, pp=16, checkpoint="none", ep=1, act=4.0, peak=10.0, gap=1.0, act_gap=1.0, sent=0.0):
    """A simulation's JSON as course/gpt_at_scale.py writes it, in GiB; ``gap``/``act_gap`` scale the measured
    states / activations against the formula."""
    formula = dict(params=1.0, grads=1.0, optimizer=2.0, activations=act, blocks=8, **{"all-to-all bytes sent": sent})
    measured = {"params": gap, "grads": 1.0, "optimizer": 2.0, "activations after forward": act * act_gap,
                "all-to-all bytes sent": sent, "peak": peak, "unsharded params": 0.5, "all-gather buffers": 0.5,
                "temporaries": 1.0, "reduce-scatter buffers": 0.0}
    gib = lambda d: {k: (v * GIB if k != "blocks" else v) for k, v in d.items()}  # noqa: E731
    return dict(model="llama3-405b", world=16384, dp=128, tp=8, pp=pp, ep=ep, stage=stage, checkpoint=checkpoint,
                measured=gib(measured), formula=gib(formula))


def verdicts(capsys) -> list[bool]:
    return [v for _, v in checks.parse(capsys.readouterr().out)]


def test_the_formula_claim_holds_only_while_states_and_activations_stay_within_their_tolerances(capsys):
    lesson.claim_formula([result(), result(stage=15, act_gap=0.97)])
    lesson.claim_formula([result(gap=1.01)])  # a state 1% off: not the same arithmetic
    lesson.claim_formula([result(act_gap=1.06)])
    lesson.claim_formula([result(ep=64, sent=2.0), dict(result(ep=64, sent=2.0), measured=dict(
        result(ep=64, sent=2.0)["measured"], **{"all-to-all bytes sent": 3.0 * GIB}))])
    assert verdicts(capsys) == [True, False, False, False]


def test_the_busiest_moment_adds_the_optimizer_state_and_the_other_micro_batches_in_flight():
    first, last = lesson.held(result(stage=0), 16), lesson.held(result(stage=15), 16)
    assert first["in_flight"] == 16 and last["in_flight"] == 1  # 1F1B: min(p - s, m)
    assert first["total"] == pytest.approx((10 + 2 + 15 * 4) * GIB)
    assert last["total"] == pytest.approx((10 + 2) * GIB)
    assert first["states"] + first["activations"] + first["rest"] == pytest.approx(first["total"])
    assert lesson.held(result(stage=0), 4)["in_flight"] == 4  # fewer micro-batches than stages


def test_the_fit_claim_needs_the_first_stage_to_fail_without_recomputation_and_every_stage_to_fit_with_it(capsys):
    big, small = result(stage=0, act=6.0, peak=12.0), result(stage=0, checkpoint="full", act=0.25, peak=12.0)
    lesson.claim_fit({(0, "none"): big, (0, "full"): small})
    lesson.claim_fit({(0, "none"): result(stage=0, act=0.5), (0, "full"): small})  # it fits anyway
    lesson.claim_fit({(0, "none"): big, (0, "full"): result(stage=0, checkpoint="full", act=6.0, peak=12.0)})
    assert verdicts(capsys) == [True, False, False]


def long_context(act_gap=1.0, ring=22.5, ring_formula=22.5, peak=18.0) -> dict:
    """Stage 1 of Llama 3 405B at 131,072 tokens over CP 16 (made up, GiB)."""
    r = result(stage=1, act=7.5, peak=peak, act_gap=act_gap)
    r["measured"]["ring bytes sent"], r["formula"]["ring bytes sent"] = ring * GIB, ring_formula * GIB
    return dict(r, dp=8, cp=16, shape=dict(scale.MODELS["llama3-405b"], seq_len=131072))


def test_the_context_claims_need_the_short_ranks_bytes_the_formulas_ring_and_a_higher_peak(capsys):
    short = dict(result(stage=1, act=7.5, peak=13.0), shape=scale.MODELS["llama3-405b"])
    lesson.claim_context(long_context(), short)
    assert verdicts(capsys) == [True, True, True, True]
    lesson.claim_context(long_context(act_gap=1.01), short)  # CP left the rank more than its share of tokens
    lesson.claim_context(long_context(ring=30.0), short)  # the ring sent more than chapter 12's blocks
    lesson.claim_context(long_context(ring=0.0, ring_formula=0.0), short)  # no ring ran at all
    lesson.claim_context(long_context(peak=12.0), short)
    assert verdicts(capsys) == [False, True, True, True, True, False, True, True, True, False, True, True,
                                True, True, True, False]


def test_recomputation_must_resend_exactly_half_as_much_again(capsys):
    lesson.claim_recompute_resends(result(ep=64, sent=4.0), result(ep=64, sent=6.0))
    lesson.claim_recompute_resends(result(ep=64, sent=4.0), result(ep=64, sent=4.0))
    assert verdicts(capsys) == [True, False]


def test_the_published_claims_read_the_planner_and_fail_when_a_layout_does_not_fit(capsys):
    found = lesson.published()
    assert [e["name"] for e, _ in found] == [e["name"] for e in scale.PUBLISHED]
    lesson.claim_published(found)
    missing = [(e, dict(p, theirs=None, rank=None, mfu=None)) if e["name"].startswith("DeepSeek") else (e, p)
               for e, p in found]
    lesson.claim_published(missing)
    assert verdicts(capsys) == [True, True, True, False]
    lesson.show_published(found)
    table = capsys.readouterr().out
    assert "4 / 17" in table and "dp128 tp8 pp16" in table  # Llama 3 405B's place and layout, in the table


def test_local_ranks_must_stay_within_the_floors_and_match_the_real_losses(capsys):
    def run(ranks, tp, err, loss=2.0, simulated=True):
        return dict(ranks=ranks, dp=ranks // tp, tp=tp, simulated=simulated, floor=1e-8,
                    grad_error={str(r): err for r in range(ranks)}, loss={str(r): loss for r in range(ranks)})

    good = [run(4, 2, 1e-8), run(64, 4, 2e-8)]
    lesson.claim_local(good, run(4, 2, 1e-8, simulated=False))
    lesson.claim_local([run(4, 2, 1e-8), run(64, 4, 5e-8)], run(4, 2, 1e-8, simulated=False))
    lesson.claim_local(good, run(4, 2, 1e-8, loss=2.1, simulated=False))
    lesson.claim_local([run(64, 4, 1e-8)], run(4, 2, 1e-8, simulated=False))  # no 4-rank twin to compare
    assert verdicts(capsys) == [True, False, False, False]


def test_a_layout_that_cannot_be_built_is_refused_before_any_process_starts(monkeypatch, capsys):
    def no_launch(*args, **kwargs):
        raise AssertionError("a process was started for a layout that cannot be built")

    monkeypatch.setattr(lesson.launch, "python", no_launch)
    for bad in lesson.BAD:
        with pytest.raises(ValueError, match="use|divide"):
            lesson.simulate(**bad)
    lesson.claim_refusals()
    assert verdicts(capsys) == [True]
    with pytest.raises(ValueError, match="LOCAL_RANKS"):
        lesson.settings("smoke", 12)
