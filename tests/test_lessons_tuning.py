"""helpers.notebook.lessons.tuning (notebook 05): each section's claim lines say True for runs that show the lesson
and False for runs that do not, and the timing and bucket helpers compute what they say."""

import pytest

from helpers.notebook import checks
from helpers.notebook.lessons import tuning
from helpers.rank.models import SimpleCNN


class FakeRun:
    """What the lesson functions read of a launch.Run: metrics records, rank 0's result, every rank's result."""

    def __init__(self, steps=(), result=None, by_rank=None):
        self.metrics = [{"kind": "step", **r} for r in steps]
        self.result = result or {}
        self._by_rank = by_rank or {0: self.result}

    def results_by_rank(self):
        return self._by_rank


def _run(field_values: dict, nproc=1, **result):
    """One record per step and rank with the given per-step fields (lists of equal length)."""
    n = len(next(iter(field_values.values())))
    steps = [{"rank": k, "step": s + 1, **{f: v[s] for f, v in field_values.items()}}
             for k in range(nproc) for s in range(n)]
    return FakeRun(steps, result)


def _verdicts(capsys) -> list[bool]:
    return [verdict for _, verdict in checks.parse(capsys.readouterr().out)]


def test_flags_refuse_too_few_steps_for_the_warmup_comparison():
    with pytest.raises(ValueError, match="STEPS >= 20"):
        tuning.flags("smoke", "synthetic", 32, 19, warmup_steps=10, data_root="data")
    cnn, mlp = tuning.flags("smoke", "synthetic", 32, 40, warmup_steps=10, data_root="data")
    assert cnn[-2:] == ["--steps", 40] and "memory" in mlp and 10_000_000 in mlp


def test_window_step_s_is_the_median_and_spread_of_the_slowest_rank_windows():
    run = FakeRun([{"rank": k, "step": s + 1, "step_s": t} for k, times in
                   enumerate([[9, 1, 1, 2, 2, 3, 3], [9, 1, 1.5, 2, 2, 3, 3]]) for s, t in enumerate(times)])
    med, lo, hi = tuning.window_step_s(run, skip=1, windows=3)
    assert (lo, med, hi) == pytest.approx((1.25, 2.0, 3.0))  # slowest rank: [1, 1.5], [2, 2], [3, 3]


def _memory_run(rss, states_total=100 * 2**20, start=50.0, nproc=2):
    states = {"params": states_total // 4, "grads": states_total // 4, "optimizer": states_total // 2,
              "total": states_total}
    return _run({"rss_mib": rss, "step_s": [0.1] * len(rss)}, nproc=nproc, model_state_bytes=states,
                params=states_total // 16, rss_start_mib=start)


def test_memory_claims_hold_for_a_flat_curve_above_the_model_states(capsys):
    tuning.claim_memory(_memory_run([200, 210, 205, 208]), nproc=2)
    assert _verdicts(capsys) == [True, True, True]


def test_memory_claims_fail_for_memory_that_keeps_growing_or_sits_too_low(capsys):
    tuning.claim_memory(_memory_run([160, 260, 360, 460]), nproc=2)  # grows by 300 MiB against 100 of states
    assert _verdicts(capsys) == [True, True, False]
    tuning.claim_memory(_memory_run([100, 101, 102, 103]), nproc=2)  # only 50 MiB above the start
    assert _verdicts(capsys) == [True, False, True]
    tuning.claim_memory(_memory_run([200, 210, 205, 208]), nproc=3)  # a rank that never reported
    assert _verdicts(capsys)[0] is False


def test_clipping_claims_say_true_for_the_lesson_and_false_without_it(capsys):
    plain = _run({"loss": [2.3] * 5 + [6.0] + [2.3] * 14, "grad_norm": [1.4] * 20})
    clipped = _run({"loss": [2.3] * 10 + [0.5] * 10, "grad_norm": [1.4] * 20})
    clipped_ds = _run({"loss": [2.3] * 10 + [0.6] * 10, "grad_norm": [1.4002] * 20})
    clipped64 = _run({"loss": [2.3] * 5, "grad_norm": [1.4001] * 5})  # the fp32 floor: 1e-4
    tuning.claim_clipping(plain, clipped, clipped_ds, clipped64)  # 2e-4 apart: 2 floors
    assert _verdicts(capsys) == [True] * 6
    diverged_ds = _run({"loss": [2.3] * 20, "grad_norm": [1.6] * 20})
    tuning.claim_clipping(clipped, clipped, diverged_ds, clipped64)  # "plain" learns; DeepSpeed neither learns nor matches
    assert _verdicts(capsys) == [False, False, True, False, True, False]
    tight64 = _run({"loss": [2.3] * 5, "grad_norm": [1.4 + 1e-6] * 5})  # a floor of 1e-6: 2e-4 is 200 floors
    tuning.claim_clipping(plain, clipped, clipped_ds, tight64)
    assert _verdicts(capsys) == [True] * 5 + [False]


def test_warmup_claims_fail_when_the_warmup_run_spikes_early(capsys):
    lr, W = 0.01, 10
    ddp_lr = [lr * min(1, k / W) for k in range(20)]
    ds_lr = [lr * min(1, max(0, k - 1) / W) for k in range(20)]
    plain = {"lr": [lr] * 20, "loss": [2.3, 9.0] + [2.2] * 18, "grad_norm": [1.0, 80.0] + [5.0] * 18}
    ddp = {"lr": ddp_lr, "loss": [2.3] * 10 + [1.0] * 10, "grad_norm": [1.0] * 12 + [20.0] + [3.0] * 7}
    ds = {"lr": ds_lr, "loss": [2.3] * 10 + [1.1] * 10, "grad_norm": [1.0] * 13 + [15.0] + [3.0] * 6}
    tuning.claim_warmup({"plain": plain, "ddp": ddp, "ds": ds}, lr=lr, warmup_steps=W)
    assert _verdicts(capsys) == [True] * 9
    early = dict(ddp, grad_norm=[1.0, 30.0] + [3.0] * 18)  # the largest norm at a low rate, and above a tenth
    tuning.claim_warmup({"plain": plain, "ddp": early, "ds": ds}, lr=lr, warmup_steps=W)
    assert _verdicts(capsys) == [True, True, True, True, False, False, True, True, True]


def test_whole_grads_overlapping_counts_every_tensor_a_partition_touches():
    # 115 elements on 2 ranks: partitions [0, 58) and [58, 116); the 100-element tensor straddles the cut
    assert tuning.whole_grads_overlapping([10, 100, 5], 0, 2) == 2 * 110
    assert tuning.whole_grads_overlapping([10, 100, 5], 1, 2) == 2 * 105
    assert tuning.whole_grads_overlapping([10, 100, 5], 0, 1) == 2 * 115


def _precision_runs(grads_by_rank, nproc=2):
    sizes = [p.numel() for p in SimpleCNN(10).parameters()]
    P = sum(sizes)
    fp32 = FakeRun(result={"params": P, "model_state_bytes": {"params": 4 * P, "grads": 4 * P, "optimizer": 8 * P,
                                                               "total": 16 * P}})
    by_rank = {k: {"model_state_bytes": {"params": 2 * P, "grads": g, "optimizer": 12 * P // nproc,
                                         "total": 2 * P + g + 12 * P // nproc}} for k, g in grads_by_rank.items()}
    zero2 = FakeRun(result={"params": P, **by_rank[0]}, by_rank=by_rank)
    return fp32, zero2, sizes


def test_precision_claims_hold_for_straddling_gradients_and_fail_for_the_paper_formula(capsys):
    fp32, _, sizes = _precision_runs({0: 0, 1: 0})
    right = {k: tuning.whole_grads_overlapping(sizes, k, 2) for k in (0, 1)}
    _, zero2, _ = _precision_runs(right)
    tuning.claim_precision(fp32, fp32, zero2, nproc=2)
    assert _verdicts(capsys) == [True, True, True]
    P = sum(sizes)
    _, paper, _ = _precision_runs({0: P, 1: P})  # 2/N bytes per parameter: what the formula assumes, not what is held
    tuning.claim_precision(fp32, fp32, paper, nproc=2)
    assert _verdicts(capsys) == [True, False, False]


def test_ddp_buckets_of_simplecnn_are_two_with_a_1_mib_first_bucket():
    buckets = tuning.ddp_buckets(SimpleCNN(10))
    names = [n for n, _ in SimpleCNN(10).named_parameters()][::-1]
    assert len(buckets) == 2 and names[buckets[0][-1]] == "fc1.weight"


def _check(calls=2, every_calls=8, no_sync_s=0.14, every_s=0.16, diff=1e-9, floor=1e-9):
    way = lambda c, s: {"calls": c, "bytes": c * 2**20, "seconds": s, "seconds_min": s, "seconds_max": s}  # noqa
    r = {"micro_batches": 4, "micro_batch": 16, "global_batch": 128, "grad_max_abs": 0.04, "repeats": 3,
         "no_sync_max_abs_diff": diff, "every_step_max_abs_diff": diff, "fp32_floor": floor,
         "comm": {"big batch": way(2, 0.13), "no_sync": way(calls, no_sync_s), "every step": way(every_calls, every_s)}}
    return FakeRun(result=r, by_rank={0: r, 1: r})


def test_accumulation_claims_true_for_no_sync_and_false_for_a_step_that_all_reduces_each_time(capsys):
    tuning.claim_accumulation(_check(), nproc=2)
    assert _verdicts(capsys) == [True] * 6
    tuning.claim_accumulation(_check(calls=8, no_sync_s=0.2, diff=1e-3), nproc=2)
    assert _verdicts(capsys) == [False, False, False, True, True, False]
    tuning.claim_accumulation(_check(no_sync_s=0.2), nproc=1)  # one rank: no speed claim
    assert len(_verdicts(capsys)) == 5
    tuning.claim_accumulation(_check(diff=1e-6, floor=1e-10), nproc=2)  # ~200 floors (the floor is at least
    # one fp32 unit of the largest gradient, 4.8e-9 here): not the same gradient
    assert _verdicts(capsys)[:2] == [False, False]


def test_compile_claims_true_for_a_slow_first_step_and_false_for_other_losses(capsys):
    eager = _run({"loss": [2.3 - 0.01 * k for k in range(20)], "step_s": [0.1] * 20})
    compiled = _run({"loss": [2.3 - 0.01 * k + 1e-7 for k in range(20)], "step_s": [5.0] + [0.12] * 19})
    eager64 = _run({"loss": [2.3 - 0.01 * k + 1e-7 for k in range(10)], "step_s": [0.2] * 10})  # floor 1e-7
    tuning.claim_compile(eager, compiled, eager64)
    assert _verdicts(capsys) == [True, True, True]
    other = _run({"loss": [2.3] * 20, "step_s": [0.5] + [0.12] * 5 + [0.9] + [0.12] * 13})
    tuning.claim_compile(eager, other, eager64)
    assert _verdicts(capsys) == [False, False, False]
    drifted = _run({"loss": [2.3 - 0.01 * k + 1e-5 for k in range(20)], "step_s": [5.0] + [0.12] * 19})
    tuning.claim_compile(eager, drifted, eager64)  # 100 floors away
    assert _verdicts(capsys) == [False, True, True]
