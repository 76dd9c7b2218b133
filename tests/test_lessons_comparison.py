"""Notebook 04's lesson module (helpers/notebook/lessons/comparison.py): the launches it plans, and claims that say
False when the results say so."""
import pytest

from helpers.notebook.lessons import comparison as c
from helpers.notebook.scripts import _code_lines, script_diff

MIB = 2**20


def test_plan_runs_skip_plus_windows_steps_and_one_launch_per_configuration_on_a_cpu():
    plan = c.Plan.resolve("smoke", 2)
    assert (plan.steps, plan.global_batch) == (2 + 3 * 3, 32)
    launches = plan.launches(counted=True)
    assert [label for label, _, _ in launches] == ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "ZeRO-3 + offload"]
    steps = {label: args[args.index("--steps") + 1] for label, _, args in launches}
    assert steps == {"DDP": 11, "ZeRO-1": 11, "ZeRO-2": 11, "ZeRO-3": 11, "ZeRO-3 + offload": 3}  # offload: untimed
    assert all("--save-dir" in args for _, _, args in launches)
    assert len({args[args.index("--train-size") + 1] for _, _, args in launches}) == 1  # one data set for all
    assert all("--count-comms" in args for label, _, args in launches if label != "DDP")
    assert plan.launches(counted=False) == []  # a CPU: the counted launches are the timed ones


def test_plan_on_gpus_times_each_timed_configuration_again_without_counters():
    plan = c.Plan.resolve("full", 8, gpu=True)
    assert [cfg.label for cfg in plan.configs] == ["DDP", "ZeRO-0", "ZeRO-1", "ZeRO-2", "ZeRO-2 + offload", "ZeRO-3",
                                                    "ZeRO-3 + offload"]
    timed = plan.launches(counted=False)
    assert [label for label, _, _ in timed] == ["DDP", "ZeRO-0", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
    ddp = dict((label, args) for label, _, args in timed)["DDP"]
    assert "--no-count-comms" in ddp and not any("--count-comms" in a for _, _, a in timed[1:])
    assert not any("--save-dir" in a or "--bucket-size" in a for _, _, a in timed)


@pytest.mark.parametrize("kw", [{"repeats": 2}, {"repeats": True}, {"accumulation": 0}])
def test_plan_refuses_too_few_windows_and_no_micro_batch(kw):
    with pytest.raises(ValueError):
        c.Plan.resolve("smoke", 2, **kw)


def test_the_course_scripts_show_the_engine_taking_over():
    found = c.engine_takeover(_code_lines("ddp_tuning.py"), _code_lines("ds_tuning.py"),
                              script_diff("ddp_tuning.py", "ds_tuning.py", context=0))
    assert found == {"written_in_ddp": True, "left_in_ds": []}


def test_a_deepspeed_script_that_still_calls_backward_itself_is_named():
    ds = _code_lines("ds_tuning.py") + ["    loss.backward()"]
    found = c.engine_takeover(_code_lines("ddp_tuning.py"), ds, script_diff("ddp_tuning.py", "ds_tuning.py", context=0))
    assert found["left_in_ds"] == ["loss.backward()"]
    found = c.engine_takeover([], [], ["-    optimizer.step()"])  # the DDP side lacks the rest
    assert found["written_in_ddp"] is False


def test_loss_parity_uses_the_other_runs_spread_and_refuses_a_different_computation():
    base = {s: 2.0 - 0.01 * s for s in range(1, 6)}
    curves = {"DDP": base, "A": {s: v + 1e-7 for s, v in base.items()}, "B": {s: v - 1e-7 for s, v in base.items()},
              "C": dict(base)}
    assert all(r["ok"] for r in c.loss_parity(curves).values())
    curves["C"] = {s: v + 1e-3 for s, v in base.items()}  # another batch or update, not rounding
    result = c.loss_parity(curves)
    assert not result["C"]["ok"]  # its floor leaves it out: the others agree to 2e-7
    assert result["A"]["ok"]  # A's floor includes C's spread; the claim fails on C all the same


def test_zero2_keeps_the_whole_gradient_of_each_tensor_its_partition_overlaps():
    sizes = [4, 4, 2]  # 10 elements, 2 ranks: rank 0 holds 0-4 (tensors 0 and 1), rank 1 holds 5-9 (tensors 1 and 2)
    assert c.whole_grads_overlapping(sizes, 0, 2) == 4 * 8
    assert c.whole_grads_overlapping(sizes, 1, 2) == 4 * 6
    assert c.whole_grads_overlapping(sizes, 0, 1) == 4 * 10


def test_zero1_counts_as_partitioned_only_without_accumulation():
    assert c.partitioned_grads(1) == ("ZeRO-2", "ZeRO-1") and c.partitioned_grads(2) == ("ZeRO-2",)


def _speed(**medians):
    return {label.replace("_", "-"): {"median": m, "min": m * 0.95, "max": m * 1.05, "windows": [m] * 3}
            for label, m in medians.items()}


def test_speed_verdict_holds_for_slower_zero_and_refuses_a_win_beyond_the_window_spread():
    v = c.speed_verdict(_speed(DDP=60, ZeRO_1=50, ZeRO_3=30))
    assert v["none_faster"] and v["zero3_slower"] and v["ceiling"] == pytest.approx(1 + 0.1 / 1)
    v = c.speed_verdict(_speed(DDP=60, ZeRO_1=70, ZeRO_3=30))  # 1.17x against a 10% spread
    assert not v["none_faster"]
    v = c.speed_verdict(_speed(DDP=60, ZeRO_1=50, ZeRO_3=61))
    assert v["none_faster"] and not v["zero3_slower"]


def test_expected_comm_multiples_scale_with_accumulation_for_zero2_and_zero3_only():
    labels = ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "ZeRO-3 + offload"]
    assert c.expected_comm_multiples(2, labels) == {"ZeRO-1": 1.5, "ZeRO-2": 2.5, "ZeRO-3": 2.0,
                                                    "ZeRO-3 + offload": 2.0}
    assert c.expected_comm_multiples(4, labels)["ZeRO-2"] == 4.5


def _row(label, comm, states=100.0, rss=1000.0, by_rank=None):
    return {"label": label, "params": 1000, "comm_mib_per_step": comm, "model_states_mib": states,
            "max_rss_mib": rss, "model_states_mib_by_rank": by_rank or {0: states, 1: states},
            "max_rss_mib_by_rank": {0: rss, 1: rss}}


def _checks(capsys):
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("[check]")]


def test_claim_comm_says_false_when_zero2_sends_what_zero1_does(capsys):
    plan = c.Plan.resolve("smoke", 2)
    rows = [_row("DDP", 10), _row("ZeRO-1", 15), _row("ZeRO-2", 25), _row("ZeRO-3", 20), _row("ZeRO-3 + offload", 20)]
    c.claim_comm(rows, plan)
    assert all(line.split("   (")[0].endswith("True") for line in _checks(capsys))
    rows[2] = _row("ZeRO-2", 15)
    c.claim_comm(rows, plan)
    assert _checks(capsys)[-1].split("   (")[0].endswith("False")


def test_claim_memory_says_false_when_zero3_is_not_the_highest_rss(capsys):
    plan = c.Plan.resolve("smoke", 2)
    rows = [_row("DDP", 10, 300, 1100), _row("ZeRO-1", 15, 260, 1100), _row("ZeRO-2", 25, 230, 1090, {0: 230, 1: 240}),
            _row("ZeRO-3", 20, 190, 1300), _row("ZeRO-3 + offload", 20, 230, 1400)]
    c.claim_memory(rows, plan)
    assert [line.split("   (")[0].endswith("True") for line in _checks(capsys)] == [True, True, True]
    rows[0] = _row("DDP", 10, 300, 1350)
    c.claim_memory(rows, plan)
    assert [line.split("   (")[0].endswith("True") for line in _checks(capsys)] == [True, False, True]


def test_comparison_plot_marks_untimed_rows_and_an_empty_communication_panel():
    pytest.importorskip("matplotlib")
    from helpers.notebook import plots

    rows = [dict(_row(label, 0.0), checkpoint_mib=10.0, samples_per_s=None) for label in ("DDP", "ZeRO-3 + offload")]
    fig = plots.comparison(rows, speed=_speed(DDP=60))
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert "not\ntimed" in texts and "nothing sent: one rank" in texts


def test_formula_ratios_accept_zero2_only_with_the_whole_gradients_of_the_overlapped_layers():
    from helpers.calc import memory

    plan = c.Plan.resolve("smoke", 2)
    sizes = [600, 300, 100]  # rank 0's half (0-499) lies in tensor 0; rank 1's (500-999) overlaps all three
    params = sum(sizes)

    def formula(stage):
        return memory.zero_model_state_bytes(params, 2, stage, "fp32", k=memory.deepspeed_k(stage, "fp32"))

    f2 = formula(2)
    held = {r: dict(f2, total=f2["total"] - f2["grads"] + c.whole_grads_overlapping(sizes, r, 2)) for r in (0, 1)}
    ratios, fit = c.formula_ratios({"DDP": {0: formula(0), 1: formula(0)}, "ZeRO-2": held}, params, sizes, plan)
    assert ratios["DDP"] == [1.0, 1.0] and fit == pytest.approx([1.0, 1.0])
    _, fit = c.formula_ratios({"ZeRO-2": {0: f2, 1: f2}}, params, sizes, plan)  # the plain formula: not what it keeps
    assert not all(abs(x - 1) <= 0.01 for x in fit)


def test_with_one_rank_zero3_saves_nothing_and_the_claim_says_so(capsys):
    plan = c.Plan.resolve("smoke", 1)
    one = lambda label, states, rss: dict(_row(label, 0.0, states, rss), model_states_mib_by_rank={0: states},
                                          max_rss_mib_by_rank={0: rss})
    rows = [one("DDP", 304, 1100), one("ZeRO-1", 380, 1100), one("ZeRO-2", 380, 1100), one("ZeRO-3", 380.4, 1400),
            one("ZeRO-3 + offload", 455, 1500)]
    c.claim_memory(rows, plan)
    lines = _checks(capsys)
    assert "with one rank" in lines[-1] and lines[-1].endswith("True")
    rows[3] = one("ZeRO-3", 300, 1400)  # less than DDP with one rank: not what ZeRO keeps
    c.claim_memory(rows, plan)
    assert _checks(capsys)[-1].endswith("False")
