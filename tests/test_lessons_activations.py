"""helpers.notebook.lessons.activations: notebook 08's settings refuse what cannot run, and its claims say False
when the measurements contradict the prose."""
import pytest

from helpers.calc import activations
from helpers.notebook import checks
from helpers.notebook.lessons import activations as lesson


def verdicts(capsys) -> dict:
    return dict(checks.parse(capsys.readouterr().out))


class FakeRun:
    def __init__(self, result):
        self.result = result


def _row(s, b, h, attention, scale=1.0, checkpoint="none"):
    row = dict(seq_len=s, batch=b, d_model=h, n_head=4, n_layer=2, vocab=29, attention=attention, dtype="fp32",
               checkpoint=checkpoint)
    row["act_bytes"] = int(scale * lesson.formula_bytes(row))
    return row


def _memory_run(scale=1.0, full_step=0.02):
    rows = [_row(s, b, h, att, scale) for s, b, h in ((64, 8, 64), (128, 8, 64)) for att in ("math", "sdpa")]
    base = rows[0]
    ck = {mode: {"act_bytes": int(lesson.formula_bytes(base, mode)), "step_s": [t] * 5}
          for mode, t in (("none", 0.01), ("selective", 0.012), ("full", full_step))}
    return FakeRun(dict(activations=rows, checkpointing=ck, meta_init_equal=True, params=1000, peak_phase="backward",
                        peak_split=dict(param=4000, grad=0, opt=8000, act=10, temp=1, buffer=0, oth=0)))


@pytest.mark.parametrize("nproc", [1, 2, 3, 4])
def test_default_global_batch_splits_at_every_offered_nproc(nproc):
    cfg = lesson.resolve("smoke", 2, nproc=nproc)
    assert cfg.global_batch % cfg.nproc == 0 and len(cfg.sizes) >= 4


def test_bad_parameters_are_refused_with_what_to_change():
    with pytest.raises(ValueError, match="not a multiple of NPROC=5"):
        lesson.resolve("smoke", 2, nproc=5)
    with pytest.raises(ValueError, match="SEQxBATCHxWIDTH"):
        lesson.resolve("smoke", 2, sizes=["64x8"])
    with pytest.raises(ValueError, match="at least 3"):
        lesson.resolve("smoke", 2, repeats=2)


def test_formula_claims_hold_for_the_formula_and_fail_15_percent_off(capsys):
    lesson.claim_formula(_memory_run())
    assert all(verdicts(capsys).values())
    lesson.claim_formula(_memory_run(scale=1.15))
    v = verdicts(capsys)
    assert not any(ok for claim, ok in v.items() if "at all" in claim)


def test_checkpointing_claims_fail_when_recomputation_is_free(capsys):
    lesson.claim_checkpointing(_memory_run())
    assert all(verdicts(capsys).values())
    lesson.claim_checkpointing(_memory_run(full_step=0.009))
    assert not all(verdicts(capsys).values())


def test_peak_claims_need_4p_parameters_and_8p_optimizer_state(capsys):
    run = _memory_run()
    lesson.claim_peak(run)
    assert all(verdicts(capsys).values())
    run.result["peak_split"]["opt"] = 12000  # a master copy (K = 12) is not fp32 AdamW's
    lesson.claim_peak(run)
    assert not all(verdicts(capsys).values())
    run.result["peak_split"]["opt"], run.result["peak_phase"] = 8000, "optimizer step"  # AdamW's state made late
    lesson.claim_peak(run)
    assert list(verdicts(capsys).values()).count(False) == 1


def test_training_claim_fails_at_the_unigram_baseline(capsys):
    cfg = lesson.resolve("smoke", 2)
    lesson.claim_training(FakeRun(dict(test_loss=2.0, unigram_loss=2.9, global_batch=24)), cfg)
    assert all(verdicts(capsys).values())
    lesson.claim_training(FakeRun(dict(test_loss=2.8, unigram_loss=2.9, global_batch=24)), cfg)
    assert not any(verdicts(capsys).values())


def test_calculator_claim_compares_with_the_first_measured_size(capsys):
    from helpers.notebook.step_calculator import step_figures
    run = _memory_run()
    f = step_figures(1000, 1, 0, "fp32", gpt=run.result["activations"][0])
    lesson.claim_calculator(f, run)
    assert all(verdicts(capsys).values())
    f = step_figures(1000, 1, 0, "fp32", gpt=run.result["activations"][0], checkpoint="full")
    lesson.claim_calculator(f, run)
    assert not any(verdicts(capsys).values())
    assert f.activations["total"] == activations.model_bytes(64, 8, 64, 4, 2, 29, checkpoint="full")


def test_parameter_count_claim_fails_for_another_shape(capsys):
    import torch

    from helpers.rank.gpt import GPT, GPTConfig
    cfg = GPTConfig(vocab_size=7, seq_len=8, n_layer=1, n_head=2, d_model=8)
    with torch.device("meta"):
        model = GPT(cfg)
    lesson.claim_parameter_count(model, cfg)
    assert all(verdicts(capsys).values())
    lesson.claim_parameter_count(model, GPTConfig(vocab_size=7, seq_len=8, n_layer=2, n_head=2, d_model=8))
    assert not any(verdicts(capsys).values())


def test_peak_claim_fails_when_the_peak_holds_more_activations_than_the_forward(capsys):
    run = _memory_run()
    run.result["peak_split"]["act"] = run.result["checkpointing"]["none"]["act_bytes"] + 1
    lesson.claim_peak(run)
    assert not all(verdicts(capsys).values())


def test_step_calculator_follows_its_checkpoint_and_tp_controls():
    from helpers.notebook.step_calculator import step_calculator
    gpt = dict(seq_len=64, batch=8, d_model=64, n_head=4, n_layer=2, vocab=29)
    calc = step_calculator(1e5, 1, 0, "fp32", gpt=gpt)
    assert calc.figures().activations["total"] == activations.model_bytes(64, 8, 64, 4, 2, 29)
    assert "0.1M parameters" in calc.text()  # the slider reaches a course GPT's size
    calc.controls["checkpoint"].value = "full"
    assert calc.figures().activations["total"] == activations.model_bytes(64, 8, 64, 4, 2, 29, checkpoint="full")
    calc.controls["checkpoint"].value = "none"
    calc.controls["tp"].value = 4
    f = calc.figures()
    assert f.activations["total"] == activations.model_bytes(64, 8, 64, 4, 2, 29, tp=4)
    assert f.step["params"] == 4 * activations.tp_local_params(1e5, gpt, 4) and "TP degree 4" in calc.text()
    assert f.step["params"] > 4 * 1e5 / 4  # the embeddings, the head and the LayerNorms stay whole on every rank
    calc.controls["sp"].value = True
    assert calc.figures().activations["total"] < f.activations["total"]


def test_the_smoke_profile_trains_on_the_generated_text_even_with_a_corpus_on_disk():
    smoke, full = lesson.resolve("smoke", 2), lesson.resolve("full", 2)
    assert lesson.train_args(smoke)[-2:] == ["--dataset", "generated"]
    assert "--dataset" not in lesson.train_args(full)  # auto: data/text/input.txt when it is there


SMALL = dict(s=32, b=2, h=64, a=4, vocab=29, n_layer=3)


def test_fake_tensors_measure_a_layer_and_the_head_as_the_formula_counts_them(capsys):
    """FakeTensorMode (torch._subclasses, private: this test pins it) gives MemTracker every tensor's size with no
    storage, so the real-size row costs nothing; at a small shape its layer and head match the bf16 formula, and
    the claim says False for the head count the formula had before (log_softmax's output in bf16, not fp32)."""
    rows = lesson.claim_real_size(SMALL, "a small")
    assert list(verdicts(capsys).values()) == [True]
    math = next(r for r in rows if r["attention"] == "math")
    assert math["layer"] == activations.layer_bytes(32, 2, 64, 4, "bf16", "math")
    assert math["model"] == 3 * math["layer"] + math["head"]
    real = activations.head_terms

    def old_head(s, b, h, vocab, dtype="fp32"):
        return dict(real(s, b, h, vocab, dtype), **{"logits and log_softmax": 2 * 2 * s * b * vocab})
    import unittest.mock
    with unittest.mock.patch.object(activations, "head_terms", old_head):
        lesson.claim_real_size(SMALL, "a small")
    assert list(verdicts(capsys).values()) == [False]
