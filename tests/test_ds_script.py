"""course/ds_cifar10.py beyond what notebook 03 claims under nbval (every ZeRO stage trained, the same math as one
process, memory against the formula, WarmupLR, the consolidated ZeRO-3 checkpoint): a ZeRO-3 checkpoint loaded and
saved again by a second `deepspeed` launch, and the script's own checks of its flags and config, called in this
process."""
import json
import math

import pytest
import torch

from helpers import launch
from helpers.calc import dsconfig
from helpers.rank.deepspeed_facts import build_config, check_config
from helpers.rank.models import SimpleCNN

SCRIPT = "course/ds_cifar10.py"
DATA = ["--dataset", "synthetic", "--train-size", "256", "--test-size", "64"]
TIMEOUT_S = 600  # the first DeepSpeed launch on a machine JIT-builds its CPU communication op


def _config(stage, world_size=2):
    """Global batch 64 at any world size: 32 per rank on 2 ranks, 64 on one."""
    return build_config(stage=stage, micro_batch=64 // world_size, world_size=world_size, warmup_steps=5, clip=1.0)


@pytest.mark.slow
def test_a_zero3_checkpoint_loaded_and_saved_again_round_trips_the_parameters(runs_root):
    """Train and save at ZeRO-3; load it on both ranks, train 0 steps, save again: the same fp32 weights (gathered
    from the shards by zero_to_fp32), the same step count and the same test accuracy."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    ckpt, again = runs_root / "ckpt", runs_root / "again"
    first = launch.deepspeed(SCRIPT, nproc=2, config=_config(3), timeout=TIMEOUT_S, show="none",
                             args=[*DATA, "--save-dir", ckpt], name="saved")
    run = launch.deepspeed(SCRIPT, nproc=2, config=_config(3), timeout=TIMEOUT_S, show="none",
                           args=[*DATA, "--load-dir", ckpt, "--steps", "0", "--save-dir", again], name="loaded")
    assert f"resumed from {ckpt}" in run.log(0)
    assert run.result["optimizer_steps"] == first.result["optimizer_steps"] == math.ceil(128 / 32)
    assert run.result["test_accuracy"] == first.result["test_accuracy"]
    before, after = (get_fp32_state_dict_from_zero_checkpoint(str(d)) for d in (ckpt, again))
    assert before.keys() == after.keys() == SimpleCNN().state_dict().keys()
    for name in before:
        assert torch.equal(before[name], after[name]), name


def test_fp16_on_cpu_is_refused_with_what_to_change():
    """What ds_cifar10.py does with --dtype fp16 before DeepSpeed sees the config: override, then check_config."""
    with pytest.raises(dsconfig.ConfigError) as refused:
        check_config(dsconfig.override(_config(0), dtype="fp16"), 2, accelerator="cpu")
    assert 'set "bf16": {"enabled": true}' in str(refused.value)


def test_config_file_stage_and_dtype_are_overridden_by_the_flags(tmp_path):
    """--stage 2 --dtype bf16 over a stage-0 fp32 file: the flags win, the file itself is untouched."""
    path = dsconfig.save(build_config(stage=0, micro_batch=16, world_size=2), tmp_path / "ds.json")
    config = dsconfig.override(dsconfig.load(path), stage=2, dtype="bf16")
    check_config(config, 2, accelerator="cpu")
    assert config["zero_optimization"]["stage"] == 2 and config["bf16"]["enabled"] is True
    assert not config.get("fp16", {}).get("enabled")
    assert json.loads(path.read_text())["zero_optimization"] == {"stage": 0}
