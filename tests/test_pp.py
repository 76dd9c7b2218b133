"""Pipeline parallelism: the formulas and measurements of helpers/calc/pipeline.py, the launch rules of
course/gpt_pp.py, the stopwatch's hold on torch's PipelineStage, and the script's own refusal (notebook 10 runs it on
real gloo ranks under nbval; tests/test_pp_schedules.py runs every schedule)."""
from __future__ import annotations

import pytest

from helpers import launch
from helpers.calc import mesh, pipeline
from helpers.launch import Machine
from helpers.launch.spec import _launch_defaults, _launch_rules

SCRIPT = launch.PROJECT_ROOT / "course" / "gpt_pp.py"
CPU = Machine(gpus=0, cpus=8)


# ---------------------------------------------------------------------------------------------- formulas


def test_bubble_formula():
    assert pipeline.bubble_fraction(1, 4) == 0
    assert pipeline.bubble_fraction(2, 4) == pytest.approx(1 / 5)
    assert pipeline.bubble_fraction(4, 8) == pytest.approx(3 / 11)
    with pytest.raises(ValueError):
        pipeline.bubble_fraction(2, 0)


def test_stages_are_balanced_blocks_and_placed_looped_or_v_shaped():
    assert pipeline.stage_layers(8, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="do not split"):
        pipeline.stage_layers(6, 4)
    assert pipeline.stages_of_rank("1f1b", 1, 4) == [1]
    assert pipeline.stages_of_rank("interleaved1f1b", 1, 4) == [1, 5]
    assert pipeline.stages_of_rank("zbv", 0, 2) == [0, 3] and pipeline.stages_of_rank("dualpipev", 1, 2) == [1, 2]
    for name in pipeline.SCHEDULES:  # every stage on exactly one rank
        for world in (2, 4):
            held = sorted(s for r in range(world) for s in pipeline.stages_of_rank(name, r, world))
            assert held == list(range(world * pipeline.SCHEDULES[name][1]))


def _gpipe_timeline(p: int, m: int, f: float = 1.0, b: float = 2.0) -> list[dict]:
    """An ideal GPipe step: stage s runs forward i in slot s + i, its backwards after the last forward drains."""
    acts = []
    for s in range(p):
        for i in range(m):
            acts.append({"rank": s, "stage": s, "kind": "F", "mb": i, "t0": (s + i) * f, "t1": (s + i + 1) * f})
            t0 = (m + p - 1) * f + (p - 1 - s + i) * b
            acts.append({"rank": s, "stage": s, "kind": "B", "mb": i, "t0": t0, "t1": t0 + b})
    return acts


@pytest.mark.parametrize("p, m", [(2, 1), (2, 4), (4, 8), (3, 5)])
def test_an_ideal_timeline_measures_exactly_the_formula(p, m):
    bubbles = pipeline.measured_bubble(_gpipe_timeline(p, m))
    assert all(b == pytest.approx(pipeline.bubble_fraction(p, m)) for b in bubbles.values())
    assert pipeline.held_microbatches(_gpipe_timeline(p, m), 0) == m  # GPipe: every micro-batch at once


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (3, 5)])
def test_a_replay_keeps_order_and_durations_and_drops_the_waits(p, m):
    ideal = _gpipe_timeline(p, m)
    waited = [dict(a, t0=a["t0"] + 0.3 * a["rank"] + 0.05 * a["mb"], t1=a["t1"] + 0.3 * a["rank"] + 0.05 * a["mb"])
              for a in ideal]  # every action later by a message latency that grows along the pipeline
    replayed = pipeline.replay(waited, p)
    def key(acts):
        return sorted((a["rank"], a["kind"], a["mb"], round(a["t1"] - a["t0"], 9)) for a in acts)

    assert key(replayed) == key(ideal)
    formula = pipeline.bubble_fraction(p, m)
    assert all(b == pytest.approx(formula) for b in pipeline.measured_bubble(replayed).values())
    assert all(b > formula for b in pipeline.measured_bubble(waited).values())
    steps = [waited, waited]
    assert pipeline.steady_bubble(steps, 0, n_stages=p)["median"] == pytest.approx(formula)
    assert pipeline.steady_bubble(steps, 0)["median"] > formula


def test_a_slow_stage_shows_as_a_larger_bubble_elsewhere():
    acts = _gpipe_timeline(2, 4)
    for a in acts:
        if a["rank"] == 1:
            a["t0"], a["t1"] = a["t0"], a["t0"] + 0.5 * (a["t1"] - a["t0"])  # rank 1 does half the work
    b = pipeline.measured_bubble(acts)
    assert b[1] > pipeline.bubble_fraction(2, 4) + 0.1 and b[0] == pytest.approx(pipeline.bubble_fraction(2, 4))


def test_steady_bubble_skips_warm_up_and_reports_the_spread():
    steps = [_gpipe_timeline(2, 4, f=10.0)] + [_gpipe_timeline(2, 4)] * 3
    steps[0][0]["t1"] += 100  # a slow first step
    out = pipeline.steady_bubble(steps, skip=1)
    assert out["median"] == pytest.approx(0.2) and out["steps"] == 3 and out["min"] == out["max"]


# ---------------------------------------------------------------------------------------------- rules


@pytest.mark.parametrize("nproc, args, problem", [
    (4, ["--n-layer", "6"], "--n-layer 6 does not split into 4 equal pipeline stages"),
    (2, ["--n-layer", "6", "--schedule", "zbv"], "--n-layer 6 does not split into 4 equal pipeline stages"),
    (2, ["--microbatches", "3"], "--microbatches 3 does not divide --batch-size 8"),
    (2, ["--microbatches", "4", "--batch-size", "6"], "--microbatches 4 does not divide --batch-size 6"),
    (4, ["--microbatches", "2"], "--schedule 1f1b needs at least as many micro-batches as stages"),
    (2, ["--microbatches", "2", "--schedule", "dualpipev"], "--schedule dualpipev needs at least as many"),
    (3, [], "--n-layer 8 does not split into 3"),
    (2, [], None), (4, ["--schedule", "gpipe", "--microbatches", "1"], None), (1, ["--microbatches", "1"], None),
    (4, ["--schedule", "interleaved1f1b", "--microbatches", "1"], None), (3, ["--n-layer", "6"], None),
    (4, ["--schedule", "gpipe", "1f1b", "--microbatches", "4"], None),  # several in one launch: each is checked
    (4, ["--schedule", "gpipe", "1f1b", "--microbatches", "2"], "--schedule 1f1b needs at least as many"),
    (2, ["--schedule", "interleaved1f1b", "gpipe", "--n-layer", "6"], "--n-layer 6 does not split into 4"),
])
def test_bad_pp_input_is_refused_before_launch_and_good_input_passes(nproc, args, problem):
    if problem is None:
        assert launch.LaunchSpec.check("torchrun", SCRIPT, nproc, args, machine=CPU).nproc == nproc
        return
    with pytest.raises(launch.LaunchError, match=problem) as e:
        launch.LaunchSpec.check("torchrun", SCRIPT, nproc, args, machine=CPU)
    assert " use " in str(e.value)


def test_the_pp_script_declares_its_rules_and_its_defaults_match_its_parser(monkeypatch):
    import course.gpt_pp as script

    assert _launch_rules(SCRIPT) == script.LAUNCH_RULES
    assert _launch_defaults(SCRIPT) == script.LAUNCH_DEFAULTS
    assert all(rule in mesh.RULES for rule in script.LAUNCH_RULES.values())
    monkeypatch.setattr("sys.argv", ["gpt_pp.py"])
    args = script.parse_args()
    value = {f: getattr(args, f[2:].replace("-", "_")) for f in script.LAUNCH_DEFAULTS}
    assert {f: " ".join(v) if isinstance(v, list) else str(v) for f, v in value.items()} == script.LAUNCH_DEFAULTS


def test_the_stopwatch_wraps_methods_torch_pipeline_stages_have():
    """Private-ish API pin: the schedules call these three methods of _PipelineStageBase for their compute."""
    import inspect

    from torch.distributed.pipelining.stage import _PipelineStageBase

    for name, first in (("forward_one_chunk", "fwd_chunk_id"), ("backward_one_chunk", "bwd_chunk_id"),
                        ("backward_weight_one_chunk", "bwd_chunk_id")):
        params = list(inspect.signature(getattr(_PipelineStageBase, name)).parameters)
        assert params[1] == first
    assert list(inspect.signature(_PipelineStageBase.backward_one_chunk).parameters)[3] == "full_backward"


# ---------------------------------------------------------------------------------------------- the script's refusal


def test_the_script_refuses_the_same_input_inside_its_ranks_from_a_terminal(refused_in_rank):
    stopped = refused_in_rank(SCRIPT, ["--microbatches", "3", "--steps", "1"])
    assert "--microbatches 3 does not divide --batch-size 8" in stopped


def test_torch_1f1b_action_list_numbers_the_last_stages_forwards_from_1():
    """Private API pin (Schedule1F1B._get_pipeline_order, torch 2.14.1): the last stage has no warm-up forwards, and
    the list's forward counter is incremented before its first forward, so it reads F1 B0 F2 B1 ... where the
    schedule runs F0 B0 F1 B1 ... (notebook 10 prints the difference). The other stages' lists match what runs."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import Schedule1F1B

    order = Schedule1F1B._get_pipeline_order(SimpleNamespace(_num_stages=3, _n_microbatches=4))
    compute = {r: [str(a) for a in acts if a is not None and "REDUCE" not in str(a)] for r, acts in order.items()}
    assert compute[2] == ["2F1", "2B0", "2F2", "2B1", "2F3", "2B2", "2F4", "2B3"]
    assert compute[0] == ["0F0", "0F1", "0F2", "0B0", "0F3", "0B1", "0B2", "0B3"]


def test_the_loss_counts_toward_the_last_micro_batch_and_states_count_local_bytes():
    import torch

    from helpers.rank.pipeline import StageClock, lm_loss, state_bytes

    clock = StageClock()
    clock._bytes, clock._held, clock._peak = {(1, 0): 100, (1, 1): 100}, {1: 200}, {1: 200}
    logits = torch.randn(2, 3, 5, requires_grad=True)
    loss = clock.loss_fn(lm_loss, 1)(logits, torch.zeros(2, 3, dtype=torch.long))
    saved = clock._bytes[(1, 1)] - 100
    assert saved >= 2 * 3 * 5 * 4 + 2 * 3 * 8  # log_softmax's output and the int64 targets
    assert clock._bytes[(1, 0)] == 100 and clock.peak_bytes() == {"1": 200 + saved}
    loss.backward()
    model = torch.nn.Linear(4, 3, bias=False)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    assert state_bytes(model, opt) == {"params": 48, "grads": 48, "optimizer": 48 + 48 + 4}
