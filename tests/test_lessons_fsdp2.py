"""helpers.notebook.lessons.fsdp2: notebook 07's settings refuse what cannot run, and its claims say False when the
measurements contradict the prose."""
from __future__ import annotations

import pytest
import torch

from helpers.calc import memory
from helpers.notebook import checks
from helpers.notebook.lessons import fsdp2 as lesson
from helpers.rank import models


def verdicts(capsys) -> dict[str, bool]:
    """The claim lines printed since the last call: {claim: verdict}."""
    return dict(checks.parse(capsys.readouterr().out))


class FakeRun:
    def __init__(self, result: dict, by_rank: dict | None = None, records=()):
        self.result, self._by_rank, self.metrics, self.run_dir = result, by_rank or {}, list(records), "fake"

    def results_by_rank(self):
        return self._by_rank


def cpu(**kw) -> lesson.Settings:
    return lesson.resolve("smoke", 0, 2, **kw)


# ------------------------------------------------------------------------------------------------ settings


@pytest.mark.parametrize("nproc", [1, 2, 3, 4])
def test_default_batch_resumes_on_another_rank_count_that_splits_it_at_every_offered_nproc(nproc):
    cfg = cpu(nproc=nproc)
    assert cfg.resume_nproc == {1: 2, 2: 3, 3: 4, 4: 3}[nproc]  # 48 does not split over 5 ranks
    assert cfg.global_batch % cfg.nproc == 0 and cfg.global_batch % cfg.resume_nproc == 0


def test_a_batch_that_the_ranks_cannot_split_is_refused_with_what_to_change():
    with pytest.raises(ValueError, match="GLOBAL_BATCH=48 is not a multiple of RESUME_NPROC=5"):
        cpu(nproc=4, resume_nproc=5)
    with pytest.raises(ValueError, match="GLOBAL_BATCH=50 is not a multiple of NPROC=3"):
        cpu(nproc=3, global_batch=50)
    assert cpu(nproc=4, global_batch=60).resume_nproc == 5


def test_gpu_default_resumes_on_half_the_ranks():
    assert lesson.resolve("full", 4, 4).resume_nproc == 2
    assert lesson.resolve("full", 1, 1).resume_nproc == 1


def test_fewer_than_three_windows_or_too_few_steps_are_refused():
    with pytest.raises(ValueError, match="at least 3"):
        cpu(windows=2)
    with pytest.raises(ValueError, match="raise STEPS"):
        cpu(steps=4, skip_steps=2, windows=3)


# ------------------------------------------------------------------------------------------------ section 1, 2


def test_script_claims_hold_for_the_fsdp2_script_and_fail_for_the_ddp_script(capsys):
    lesson.claim_script_changes("ddp_cifar10.py", "fsdp2_cifar10.py")
    assert all(verdicts(capsys).values())
    lesson.claim_script_changes("ddp_cifar10.py", "ddp_cifar10.py")
    assert not any(verdicts(capsys).values())


def _materialise(seed: int):
    with torch.device("meta"):
        model = models.SimpleCNN()
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    for m in model.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    return model


def test_meta_init_matches_a_normal_build_with_the_same_seed_only(capsys):
    lesson.claim_meta_init(_materialise(0), models.SimpleCNN, was_meta=True, seed=0)
    assert list(verdicts(capsys).values()) == [True]
    lesson.claim_meta_init(_materialise(1), models.SimpleCNN, was_meta=True, seed=0)
    assert list(verdicts(capsys).values()) == [False]
    lesson.claim_meta_init(_materialise(0), models.SimpleCNN, was_meta=False, seed=0)
    assert list(verdicts(capsys).values()) == [False]


def test_layer_table_counts_the_layers_that_hold_parameters(capsys):
    with torch.device("meta"):
        layers = lesson.layer_table(models.SimpleCNN())
    assert layers == {"conv1": 896, "conv2": 18_496, "fc1": 524_416, "fc2": 1_290}
    assert "545,098" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------ section 4


def test_same_losses_hold_within_the_floor_and_fail_for_a_shifted_curve(capsys):
    one = [2.0 - 0.01 * i for i in range(8)]
    one64 = [x + 1e-6 for x in one]
    first = {label: one[:4] for label in lesson.SYSTEMS}
    kw = dict(first64=one64[:4], again64=one64[4:], resumed_from=4, nproc=2, resume_nproc=3)
    lesson.claim_same_losses(one, one64, first, one[4:], **kw)
    assert all(verdicts(capsys).values())
    lesson.claim_same_losses(one, one64, dict(first, DDP=[x + 1e-2 for x in one[:4]]), one[4:], **kw)
    got = verdicts(capsys)
    assert [v for k, v in got.items() if k.startswith("DDP, DeepSpeed")] == [False]
    lesson.claim_same_losses(one, one64, first, one[4:], **dict(kw, resumed_from=3))
    assert [v for k, v in verdicts(capsys).items() if k.startswith("the run resumed")] == [False]


def test_fp64_twins_of_the_wrong_length_are_refused():
    one = [1.0] * 8
    with pytest.raises(ValueError, match="fp64 twins"):
        lesson.claim_same_losses(one, one[:6], {"FSDP2": one[:4]}, one[4:], first64=one[:4], again64=one[4:],
                                 resumed_from=4, nproc=2, resume_nproc=3)


# ------------------------------------------------------------------------------------------------ memory, speed


def _state_run(label: str, n: int, params: int, scale: float = 1.0) -> FakeRun:
    stage, k = lesson.ZERO[label]
    total = memory.zero_model_state_bytes(params, n, stage, "fp32", k=k)["total"] * scale
    states = {"total": total}
    return FakeRun({"model_state_bytes": states}, {r: {"model_state_bytes": states} for r in range(n)})


def test_memory_claims_fail_when_a_rank_holds_more_than_the_formula(capsys):
    cfg, params = cpu(nproc=2), 545_098
    runs = {label: _state_run(label, 2, params) for label in lesson.SYSTEMS}
    runs.update(resumed=_state_run("FSDP2", 3, params), bf16=_state_run("FSDP2", 2, params))
    lesson.claim_memory(runs, cfg, params)
    assert all(verdicts(capsys).values())
    runs["bf16"] = _state_run("FSDP2", 2, params, scale=1.5)
    lesson.claim_memory(runs, cfg, params)
    got = verdicts(capsys)
    assert not got["on every rank of every run, measured model states are within 5% of the formula"]
    assert not [v for k, v in got.items() if k.startswith("bf16")][0]


def _timed_run(step_s: list[float], nproc: int, timed: int) -> FakeRun:
    records = [{"kind": "step", "rank": r, "step": i, "step_s": s} for r in range(nproc) for i, s in enumerate(step_s)]
    return FakeRun({"timed_steps": timed}, records=records)


def test_speed_claim_says_false_when_a_sharded_system_beats_ddp_beyond_the_windows_spread(capsys):
    cfg = cpu(nproc=2)
    ok = {"DDP": 0.10, "ZeRO-3": 0.15, "FSDP2": 0.16}
    runs = {label: _timed_run([1.0, 1.0] + [s] * 10, 2, 10) for label, s in ok.items()}
    speed = lesson.speeds(runs, cfg)
    assert speed["DDP"] == pytest.approx((480.0, 480.0, 480.0))  # 48 samples in 0.1 s
    lesson.claim_speed(runs, cfg, speed)
    assert all(verdicts(capsys).values())
    runs["FSDP2"] = _timed_run([1.0, 1.0] + [1.0] * 10, 2, 10)  # 0.1x DDP: slow is not a claim, it is printed
    lesson.claim_speed(runs, cfg, lesson.speeds(runs, cfg))
    assert all(verdicts(capsys).values())
    runs["FSDP2"] = _timed_run([1.0, 1.0] + [0.05, 0.06, 0.05] * 3 + [0.05], 2, 10)  # 2x DDP, beyond its spread
    lesson.claim_speed(runs, cfg, lesson.speeds(runs, cfg))
    assert [v for k, v in verdicts(capsys).items() if k.startswith("on this CPU")] == [False]


def test_the_comparison_plot_gives_model_states_their_own_panel():
    import matplotlib

    matplotlib.use("Agg")
    cfg = cpu(nproc=2)
    rows = [dict(label=label, model_states_mib=m, formula_mib=m, max_rss_mib=500.0, samples_per_s=400.0,
                 comm_mib_per_step=2.0, checkpoint_mib=6.0) for label, m in zip(lesson.SYSTEMS, (8.3, 5.3, 4.2))]
    speed = {label: (400.0, 380.0, 420.0) for label in lesson.SYSTEMS}
    fig = lesson.plot_comparison(rows, speed, cfg)
    states = fig.axes[0]
    assert states.get_title() == "model states per rank"
    assert states.get_ylim()[1] < 20  # scaled to the states, not to the hundreds of MiB of process memory
    curves = {label: [1.0] * 12 for label in ("FSDP2", "ZeRO-3", "DDP", "resumed")}
    assert len(lesson.plot_losses(dict(curves, **{"one process": [1.0] * 24}), cfg).axes[0].lines) == 5


def test_the_other_runs_go_side_by_side_and_each_resume_after_every_save(monkeypatch):
    """Section 3's six runs: results by label in the order given; no run that loads a checkpoint starts before every
    run that might save one has ended (stand-in launches, recorded with their start and end)."""
    import threading
    import time

    from helpers import launch

    events, lock = [], threading.Lock()

    def fake_torchrun(script, nproc=None, args=(), **kw):
        with lock:
            events.append(("start", kw["name"]))
        time.sleep(0.02)
        with lock:
            events.append(("end", kw["name"]))
        return (kw["name"], nproc)

    monkeypatch.setattr(launch, "torchrun", fake_torchrun)
    more = {"one process": (1, ["--steps", 2]), "resumed": (3, ["--load-dir", "ckpt/FSDP2"]),
            "bf16": (2, ["--bf16"]), "FSDP2 fp64": (2, ["--save-dir", "ckpt/FSDP2_fp64"]),
            "resumed fp64": (3, ["--load-dir", "ckpt/FSDP2_fp64"])}
    runs = lesson.launch_more("course/fsdp2_cifar10.py", more, timeout=1)
    assert list(runs) == list(more) and runs["resumed"] == ("07_resumed", 3)
    first_resume = min(i for i, (kind, name) in enumerate(events) if kind == "start" and "resumed" in name)
    ended = {name for kind, name in events[:first_resume] if kind == "end"}
    assert ended == {"07_one_process", "07_bf16", "07_FSDP2_fp64"}
