"""helpers.notebook.exercises.zero (notebooks 03 and 04): right answers pass, each kind of wrong answer gets its own
hint, and nothing raises. The right answers are computed here from the formulas, independently of the checkers."""
import pytest

from helpers.rank.deepspeed_facts import build_config
from helpers.notebook.exercises import Verdict
from helpers.notebook.exercises import zero

GIB = 2**30
GARBAGE = ["twelve", [1, 2], {"a": 1}, object(), float("nan"), True]


def gpu_config(stage, dtype="bf16", micro=4, acc=8, world=8, **kw):
    return build_config(stage=stage, dtype=dtype, micro_batch=micro, accumulation=acc, world_size=world,
                        accelerator="cuda", **kw)


# -- 03, exercise 1: a ds_config for a budget ------------------------------------------------------------------------
# 1.5e9 parameters on 8 GPUs, mixed precision: stage 0 24 B/param = 33.5 GiB, stage 1 4 + 12/8 = 5.5 B -> 7.7 GiB,
# stage 2 2 + 14/8 = 3.75 B -> 5.2 GiB, stage 3 16/8 = 2 B -> 2.8 GiB.  Budget 6 GiB: stage 2 is the lowest fit.
BUDGET = dict(params=1.5e9, world_size=8, budget_gib=6, micro_batch=4, accumulation=8)


def test_budget_config_right_answer_accepted():
    v = zero.check_config_for_budget(gpu_config(2), **BUDGET)
    assert isinstance(v, Verdict) and v.ok, v
    assert "stage 2" in v.message


@pytest.mark.parametrize("config, words", [
    ({}, "empty"),
    ("stage 2", "dict"),
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8,
      "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}, "validator"),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8, "zero_optimisation": {"stage": 2},
      "bf16": {"enabled": True}}, "validator"),
])
def test_budget_config_malformed(config, words):
    v = zero.check_config_for_budget(config, **BUDGET)
    assert not v.ok and words in (v.message + v.hint)


def test_budget_config_each_wrong_kind_has_its_own_hint():
    hints = {}
    hints["batch"] = zero.check_config_for_budget(gpu_config(2, micro=8, acc=4), **BUDGET)
    hints["offload"] = zero.check_config_for_budget(gpu_config(2, offload="optimizer"), **BUDGET)
    hints["fp32"] = zero.check_config_for_budget(gpu_config(3, dtype="fp32"), **BUDGET)
    hints["too low"] = zero.check_config_for_budget(gpu_config(1), **BUDGET)
    hints["too high"] = zero.check_config_for_budget(gpu_config(3), **BUDGET)
    assert not any(v.ok for v in hints.values())
    assert "micro batch" in hints["batch"].hint
    assert "offload" in hints["offload"].hint
    assert "bf16" in hints["fp32"].hint
    assert "Partition more" in hints["too low"].hint and "7.7 GiB" in hints["too low"].message
    assert "lower stage" in hints["too high"].message
    assert len({v.hint for v in hints.values()}) == len(hints)
    for v in hints.values():  # a hint never gives the stage away
        assert "stage 2" not in v.hint


def test_budget_config_nothing_fits():
    v = zero.check_config_for_budget(gpu_config(3), **dict(BUDGET, budget_gib=1))
    assert not v.ok and "Even stage 3" in v.hint


# -- 03, exercise 2: DeepSpeed's estimate ------------------------------------------------------------------------------
P, N = 1.3e9, 4


def test_estimator_right_answer_accepted():
    right = (2 * P + 18 * P / N) / GIB
    assert zero.check_estimator_gib(right, params=P, world_size=N).ok
    assert zero.check_estimator_gib(round(right, 2), params=P, world_size=N).ok


def test_estimator_right_answer_is_what_deepspeed_computes():
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    _, gpu = estimate_zero2_model_states_mem_needs(int(P), num_gpus_per_node=N, cpu_offload=False)
    assert zero.check_estimator_gib(gpu / GIB, params=P, world_size=N).ok


@pytest.mark.parametrize("nbytes, words", [
    ((2 * P + 18 * P / N) * GIB / 1e9, "2**30"),           # GB instead of GiB
    (4 * P + 16 * P / N, "older DeepSpeed"),
    (2 * P + 16 * P / N, "paper's formula"),
    (18 * P / N, "Two terms"),
    (1.0 * GIB, "Count bytes"),
])
def test_estimator_wrong_answers_get_their_hint(nbytes, words):
    v = zero.check_estimator_gib(nbytes / GIB, params=P, world_size=N)
    assert not v.ok and words in v.hint, v


@pytest.mark.parametrize("answer", GARBAGE + [None])
def test_estimator_garbage_never_raises(answer):
    v = zero.check_estimator_gib(answer, params=P, world_size=N)
    assert isinstance(v, Verdict) and not v.ok


# -- 04, exercise 1: the lowest stage that fits ----------------------------------------------------------------------
# 7.5e9 parameters on 64 GPUs (the paper's example): 120, 31.4, 16.6, 1.9 GB per GPU by stage (DeepSpeed's K = 12).
PAPER = dict(params=7.5e9, world_size=64)


@pytest.mark.parametrize("budget_gib, right", [(200, 0), (40, 1), (20, 2), (10, 3), (1, None)])
def test_smallest_stage_right_answer_accepted(budget_gib, right):
    assert zero.check_smallest_stage(right, budget_gib=budget_gib, **PAPER).ok


def test_smallest_stage_wrong_answers():
    low = zero.check_smallest_stage(1, budget_gib=20, **PAPER)
    high = zero.check_smallest_stage(3, budget_gib=20, **PAPER)
    gave_up = zero.check_smallest_stage(None, budget_gib=20, **PAPER)
    none_fits = zero.check_smallest_stage(3, budget_gib=1, **PAPER)
    assert not any(v.ok for v in (low, high, gave_up, none_fits))
    assert "Go up a stage" in low.hint
    assert "lower stages" in high.hint
    assert "before giving up" in gave_up.hint
    assert "None" in none_fits.hint
    assert len({low.hint, high.hint, gave_up.hint, none_fits.hint}) == 4


@pytest.mark.parametrize("answer", GARBAGE + [7, -1, 2.5])
def test_smallest_stage_garbage_never_raises(answer):
    v = zero.check_smallest_stage(answer, budget_gib=20, **PAPER)
    assert isinstance(v, Verdict) and not v.ok


def test_smallest_stage_fp32_uses_deepspeeds_k():
    # fp32: stage 0 is 16 B/param (torch AdamW), ZeRO stages keep a 12-byte fp32 master copy + moments
    p, n = 1e9, 2
    s0, s1 = 16 * p, 8 * p + 12 * p / n  # 14.9 GiB, 13.0 GiB
    assert zero.check_smallest_stage(1, params=p, world_size=n, budget_gib=s1 / GIB + 0.1, precision="fp32").ok
    assert zero.check_smallest_stage(0, params=p, world_size=n, budget_gib=s0 / GIB + 0.1, precision="fp32").ok


# -- 04, exercise 2: bytes per step as a multiple of DDP's -----------------------------------------------------------
@pytest.mark.parametrize("stage, acc, right", [(1, 4, 1.5), (2, 4, 4.5), (2, 2, 2.5), (1, 1, 1.5), (2, 1, 1.5)])
def test_comm_multiple_right(stage, acc, right):
    assert zero.check_comm_multiple(right, stage=stage, accumulation=acc).ok


def test_comm_multiple_matches_what_04_measured():
    # notebook 04 measured 1.5x (ZeRO-1) and 2.5x (ZeRO-2) with 2 micro batches per step
    assert zero.check_comm_multiple(1.5, stage=1, accumulation=2).ok
    assert zero.check_comm_multiple(2.5, stage=2, accumulation=2).ok


@pytest.mark.parametrize("stage, answer, words", [
    (2, 4.0, "updated only its partition"),   # forgot the all-gather
    (2, 5.0, "(N-1)/N"),                      # all-gather weighed like an all-reduce
    (2, 1.5, "That is ZeRO-1"),
    (1, 4.5, "accumulate locally"),
    (2, 2.5, "2 micro batches"),
    (2, 7.0, "Count the collectives"),
])
def test_comm_multiple_wrong_answers_get_their_hint(stage, answer, words):
    v = zero.check_comm_multiple(answer, stage=stage, accumulation=4)
    assert not v.ok and words in v.hint, v
    assert "4.5" not in v.hint and "1.5x" not in v.hint


@pytest.mark.parametrize("answer", GARBAGE + [None])
def test_comm_multiple_garbage_never_raises(answer):
    v = zero.check_comm_multiple(answer, stage=2, accumulation=4)
    assert isinstance(v, Verdict) and not v.ok
