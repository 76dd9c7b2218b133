"""course/ds_cifar10.py, launched for real through helpers.launch.deepspeed: two CPU ranks at ZeRO stages 0-3."""
import json
import math
import statistics

import pytest
import torch

from helpers.calc import dsconfig, parity
from helpers.rank.deepspeed_facts import build_config
from helpers import launch
from helpers.rank.data import get_datasets
from helpers.rank.metrics import steps
from helpers.rank.models import SimpleCNN

pytestmark = pytest.mark.slow

SCRIPT = "course/ds_cifar10.py"
DATA = ["--dataset", "synthetic", "--train-size", "2000", "--test-size", "500"]
TIMEOUT_S = 600  # the first DeepSpeed launch on a machine JIT-builds its CPU communication op


def _config(stage, world_size=2):
    """Global batch 64 at any world size: 32 per rank on 2 ranks, 64 on one."""
    return build_config(stage=stage, micro_batch=64 // world_size, world_size=world_size, warmup_steps=5, clip=1.0)


@pytest.fixture(scope="module")
def stage_runs(module_runs_root):
    """One run per ZeRO stage on the same data and seed, each saving a checkpoint: {stage: (Run, ckpt dir)}."""
    out = {}
    for stage in range(4):
        ckpt = module_runs_root / f"ckpt_stage{stage}"
        out[stage] = launch.deepspeed(SCRIPT, nproc=2, config=_config(stage), timeout=TIMEOUT_S, show="none",
                                      args=[*DATA, "--save-dir", ckpt], name=f"stage{stage}"), ckpt
    return out


@pytest.mark.parametrize("stage", range(4))
def test_every_zero_stage_trains_and_loss_goes_down(stage_runs, stage):
    run, _ = stage_runs[stage]
    assert run.returncode == 0 and run.result["zero_stage"] == stage and run.result["dtype"] == "fp32"
    losses = [r["loss"] for r in steps(run.metrics, rank=0)]
    assert len(losses) == math.ceil(1000 / 32)  # each rank: 1000 images in micro batches of 32
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5
    assert run.result["test_accuracy"] > 0.3  # 10 classes: chance is 0.1


@pytest.fixture(scope="module")
def one_process(module_runs_root):
    """ZeRO stage 0 on one process, on the same global batches (64 images) as the two-rank runs."""
    return launch.deepspeed(SCRIPT, nproc=1, config=_config(0, world_size=1), timeout=TIMEOUT_S, show="none",
                            args=DATA, name="one_process")


def _mean_loss(run) -> dict[int, float]:
    """The loss of the global batch per step: the mean of the ranks' losses (equal per-rank batches)."""
    by_step: dict[int, list[float]] = {}
    for r in steps(run.metrics):
        by_step.setdefault(r["step"], []).append(r["loss"])
    assert all(len(v) == run.result["world_size"] for v in by_step.values())
    return {s: statistics.fmean(v) for s, v in sorted(by_step.items())}


def test_zero_stages_change_memory_not_the_math(stage_runs, one_process):
    """Every stage computes the same updates in exact arithmetic; in fp32 they drift apart, because float addition
    is not associative and each stage sums (gradients, the clipping norm) in its own order. DeepSpeed has no fp64 to
    measure that drift against (helpers/calc/parity.py), so the floor is the spread of orderings that are equal in
    exact arithmetic: one process and the four stages. One pair's spread is a noisy measure of the drift (measured
    here: stage 0 vs one process 4.8e-7, stage 1 vs stage 0 8.1e-6), so each stage is held against the largest
    spread among the *other* orderings (leave one out): a stage that computes something else lies many floors from
    all of them, one that only rounds differently lies within parity.K floors."""
    curves = {"one process": _mean_loss(one_process), **{f"stage {s}": _mean_loss(stage_runs[s][0]) for s in range(4)}}
    assert all(sorted(c) == list(range(1, math.ceil(1000 / 32) + 1)) for c in curves.values())
    for label in [f"stage {s}" for s in range(4)]:
        others = [k for k in curves if k != label]
        floor = max(parity.spread_floor(curves[a], curves[b]) for i, a in enumerate(others) for b in others[i + 1:])
        result = parity.check(curves[label], curves["one process"], floor)
        print(f"{label} vs one process (floor from {', '.join(others)}): {parity.describe(result)}")
        assert result["ok"], f"{label} vs one process: {parity.describe(result)}"


def test_warmup_lr_schedule_comes_from_the_config_and_grad_norm_is_reported(stage_runs):
    records = steps(stage_runs[2][0].metrics, rank=0)
    lrs = [r["lr"] for r in records]
    # WarmupLR, linear from warmup_min_lr 0 to lr over 5 steps. DeepSpeed's WarmupLR starts at the minimum and
    # its first step() computes iteration 0 (also the minimum), so with a minimum of 0 the first two updates do nothing.
    assert lrs[:8] == pytest.approx([0.0, 0.0, 2e-4, 4e-4, 6e-4, 8e-4, 1e-3, 1e-3]) and lrs[-1] == pytest.approx(1e-3)
    assert all("grad_norm" in r for r in records)


def test_both_ranks_report_every_step_and_their_own_model_state_bytes(stage_runs):
    run, _ = stage_runs[3]
    per_rank = {rank: [r["step"] for r in steps(run.metrics, rank)] for rank in (0, 1)}
    assert per_rank[0] == per_rank[1] == list(range(1, math.ceil(1000 / 32) + 1))
    measured = {rank: r["model_state_bytes"] for rank, r in run.results_by_rank().items()}
    assert set(measured) == {0, 1} and all(m["total"] > 0 for m in measured.values())


def test_rank_logs_are_collected_from_the_deepspeed_launcher(stage_runs):
    run, _ = stage_runs[0]
    assert run.log(0).count("Dataset: SYNTHETIC") == 1 and "Dataset" not in run.log(1)  # rank 0 alone prints it
    assert "test accuracy" in run.log(0)


def _fp32_weights(ckpt_dir, stage):
    if stage == 0:  # no ZeRO shards: the module's weights are in the model-states file
        tag = (ckpt_dir / "latest").read_text().strip()
        return torch.load(ckpt_dir / tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    return get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir))


@pytest.mark.parametrize("stage", [0, 3])
def test_checkpoint_save_then_load_round_trips_the_parameters(stage_runs, module_runs_root, stage):
    """Load the checkpoint on both ranks, train 0 steps, save again: same weights, same step, same accuracy."""
    first, ckpt = stage_runs[stage]
    again = module_runs_root / f"again_stage{stage}"
    run = launch.deepspeed(SCRIPT, nproc=2, config=_config(stage), timeout=TIMEOUT_S, show="none",
                           args=[*DATA, "--load-dir", ckpt, "--steps", "0", "--save-dir", again])
    assert f"resumed from {ckpt}" in run.log(0)
    assert run.result["optimizer_steps"] == first.result["optimizer_steps"] == math.ceil(1000 / 32)
    assert run.result["test_accuracy"] == first.result["test_accuracy"]
    before, after = _fp32_weights(ckpt, stage), _fp32_weights(again, stage)
    assert before.keys() == after.keys() == SimpleCNN().state_dict().keys()
    for name in before:
        assert torch.equal(before[name], after[name]), name


def test_consolidated_fp32_weights_of_a_zero3_checkpoint_load_into_simple_cnn(stage_runs):
    """zero_to_fp32 gathers the rank shards into one plain state dict; it scores what the run scored."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    run, ckpt = stage_runs[3]
    model = SimpleCNN()
    model.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(str(ckpt)))  # strict: every key, right shapes
    _, test_ds, _ = get_datasets("synthetic", "data", 2000, 500, 0)
    model.eval()
    with torch.no_grad():
        images = torch.stack([test_ds[i][0] for i in range(len(test_ds))])
        labels = torch.tensor([test_ds[i][1] for i in range(len(test_ds))])
        accuracy = (model(images).argmax(dim=1) == labels).float().mean().item()
    assert accuracy == pytest.approx(run.result["test_accuracy"], abs=1.5 / len(test_ds))


def test_fp16_on_cpu_is_refused_with_what_to_change(module_runs_root):
    with pytest.raises(launch.LaunchError) as info:
        launch.deepspeed(SCRIPT, nproc=2, config=_config(0), timeout=TIMEOUT_S, show="none",
                         args=[*DATA, "--dtype", "fp16", "--steps", "1"])
    assert 'set "bf16": {"enabled": true}' in str(info.value)


def test_config_file_stage_and_dtype_are_overridden_by_the_flags(module_runs_root, tmp_path):
    path = dsconfig.save(build_config(stage=0, micro_batch=16, world_size=2), tmp_path / "ds.json")
    run = launch.deepspeed(SCRIPT, nproc=2, config=path, timeout=TIMEOUT_S, show="none",
                           args=[*DATA, "--stage", "2", "--dtype", "bf16", "--steps", "3"])
    assert (run.result["zero_stage"], run.result["dtype"], run.result["global_batch"]) == (2, "bf16", 32)
    assert json.loads(path.read_text())["zero_optimization"] == {"stage": 0}  # the file itself is untouched
