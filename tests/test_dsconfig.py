"""helpers.calc.dsconfig: built configs are ones DeepSpeed accepts, and each bad config is refused with what to change.

The checks run against the facts of the installed DeepSpeed, read by helpers.rank.deepspeed_facts (the calc module
takes them as an argument); one test shows the same checks on a hand-written DeepSpeedFacts, without DeepSpeed."""
import json

import pytest

from helpers.calc import dsconfig
from helpers.calc.dsconfig import ConfigError, DeepSpeedFacts, batch_sizes
from helpers.rank import deepspeed_facts

FACTS = deepspeed_facts.facts()


def build(**kw):
    return dsconfig.build(**kw, facts=FACTS)


def validate(config, world_size, **kw):
    return dsconfig.validate(config, world_size, facts=FACTS, **kw)


def check(config, world_size, **kw):
    return dsconfig.check(config, world_size, facts=FACTS, **kw)


class _FakeDist:
    """DeepSpeedConfig asks torch.distributed for the world size; without a process group it assumes 1."""

    def __init__(self, world_size):
        self.world_size = world_size

    def get_rank(self):
        return 0

    def get_world_size(self, *args, **kwargs):
        return self.world_size


@pytest.fixture
def deepspeed_config(monkeypatch):
    """DeepSpeed's own config parser, for a given world size, without initialising a process group."""
    import deepspeed.runtime.config as ds_config

    def parse(config, world_size):
        monkeypatch.setattr(ds_config, "dist", _FakeDist(world_size))
        return ds_config.DeepSpeedConfig(json.loads(json.dumps(config)))
    return parse


def _one(problems, *needles):
    hits = [p for p in problems if all(n in p for n in needles)]
    assert len(hits) == 1, problems
    return hits[0]


# --------------------------------------------------------------------------------------------- build


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_built_config_passes_deepspeeds_own_parser(deepspeed_config, stage, dtype):
    cfg = build(stage=stage, dtype=dtype, micro_batch=16, accumulation=2, world_size=2, warmup_steps=10, clip=1.0,
                offload="optimizer" if stage else None, accelerator="cpu")
    parsed = deepspeed_config(cfg, world_size=2)
    assert parsed.train_batch_size == 64 and parsed.train_micro_batch_size_per_gpu == 16
    assert parsed.gradient_accumulation_steps == 2 and parsed.zero_optimization_stage == stage
    assert parsed.bfloat16_config.enabled == (dtype == "bf16") and parsed.gradient_clipping == 1.0
    assert parsed.scheduler_name == "WarmupLR" and parsed.optimizer_params["torch_adam"] is True


def test_build_without_world_size_leaves_train_batch_size_to_deepspeed(deepspeed_config):
    cfg = build(micro_batch=8, accumulation=3, accelerator="cpu")
    assert "train_batch_size" not in cfg
    assert deepspeed_config(cfg, world_size=4).train_batch_size == 8 * 3 * 4


def test_build_adds_warmup_clipping_and_offload_only_when_asked():
    plain = build(accelerator="cpu")
    assert not {"scheduler", "bf16", "fp16"} & plain.keys()
    assert plain["gradient_clipping"] == 0.0, "off, explicitly: DeepSpeed 0.19 clips at 1.0 when the key is absent"
    assert plain["zero_optimization"] == {"stage": 0}
    cfg = build(stage=3, warmup_steps=50, lr=3e-4, clip=0.5, offload="both", accelerator="cpu",
                zero={"reduce_bucket_size": 1_000_000})
    assert cfg["scheduler"]["params"] == {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-4, "warmup_num_steps": 50,
                                          "warmup_type": "linear"}
    assert cfg["gradient_clipping"] == 0.5
    assert cfg["zero_optimization"] == {"stage": 3, "reduce_bucket_size": 1_000_000,
                                        "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}


def test_build_refuses_an_impossible_combination_with_the_reason():
    with pytest.raises(ConfigError, match="offload_param needs stage >= 3"):
        build(stage=2, offload="param", accelerator="cpu")
    with pytest.raises(ConfigError, match="use bf16|bf16"):
        build(dtype="fp16", accelerator="cpu")


def test_save_writes_json_the_check_accepts(tmp_path):
    path = dsconfig.save(build(stage=1, world_size=2, accelerator="cpu"), tmp_path / "sub" / "ds.json")
    assert json.loads(path.read_text())["zero_optimization"] == {"stage": 1}
    check(path, 2, accelerator="cpu")
    with pytest.raises(ConfigError, match="batch arithmetic"):
        check(path, 3, accelerator="cpu")


# --------------------------------------------------------------------------------------------- batch rule

SEED_CONFIG = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 32, "gradient_accumulation_steps": 2}


def test_seed_blog_batch_mistake_is_explained_with_the_numbers():
    msg = _one(validate(SEED_CONFIG, 2, accelerator="cpu"), "batch arithmetic")
    assert "32 x 2 x 2 = 128, not 64" in msg
    assert "'2 x 32 = 64' forgets gradient_accumulation_steps=2" in msg
    assert "train_micro_batch_size_per_gpu to 16" in msg and "train_batch_size to 128" in msg


def test_deepspeed_itself_only_asserts_on_the_seed_config(deepspeed_config):
    with pytest.raises(AssertionError, match="64 != 32 \\* 2 \\* 2"):
        deepspeed_config(SEED_CONFIG, world_size=2)


def test_implicit_micro_batch_is_resolved_like_deepspeed(deepspeed_config):
    cfg = {"train_batch_size": 64, "gradient_accumulation_steps": 2}
    resolved = batch_sizes(cfg, 2)
    assert resolved["micro_batch"] == 16 == deepspeed_config(cfg, 2).train_micro_batch_size_per_gpu
    assert resolved["explanation"] == ("train_batch_size 64 = 16 (micro batch per rank) x 2 (accumulation steps) "
                                       "x 2 (ranks)")
    assert validate(cfg, 2, accelerator="cpu") == []


def test_forgetting_the_ranks_is_named():
    assert validate(SEED_CONFIG, 1, accelerator="cpu") == []  # 32 x 2 x 1 = 64 is right on one rank
    msg = _one(validate({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 16,
                         "gradient_accumulation_steps": 4}, 2, accelerator="cpu"), "batch arithmetic")
    assert "'16 x 4 = 64' forgets that each of the 2 ranks" in msg


def test_train_batch_size_that_does_not_divide_is_refused():
    msg = _one(validate({"train_batch_size": 64, "gradient_accumulation_steps": 3}, 2, accelerator="cpu"),
               "batch arithmetic")
    assert "10 x 3 x 2 = 60, not 64" in msg and "divisible by 6" in msg


def test_missing_and_non_positive_batch_sizes_are_refused():
    _one(validate({"gradient_accumulation_steps": 2}, 2, accelerator="cpu"), "set train_micro_batch_size_per_gpu")
    _one(validate({"train_micro_batch_size_per_gpu": 0}, 2, accelerator="cpu"), "whole number >= 1")
    _one(validate({"train_micro_batch_size_per_gpu": 8.5}, 2, accelerator="cpu"), "whole number >= 1")
    _one(validate({"train_batch_size": 1}, 2, accelerator="cpu"), "too small for 2 ranks")


# --------------------------------------------------------------------------------------------- precision


def test_fp16_on_cpu_says_use_bf16_or_fp32():
    msg = _one(validate({"train_micro_batch_size_per_gpu": 8, "fp16": {"enabled": True}}, 2, accelerator="cpu"),
               "fp16")
    assert "CPU" in msg and '"bf16": {"enabled": true}' in msg and "fp32" in msg


def test_fp16_on_gpu_is_fine_and_bf16_on_old_gpu_is_refused():
    assert validate({"train_micro_batch_size_per_gpu": 8, "fp16": {"enabled": True}}, 2, accelerator="cuda") == []
    bf16 = {"train_micro_batch_size_per_gpu": 8, "bf16": {"enabled": True}}
    msg = _one(validate(bf16, 2, accelerator="cuda", capabilities=["8.0", "7.0"]), "bf16")
    assert "compute capability 8.0" in msg and "fp16" in msg
    assert validate(bf16, 2, accelerator="cuda", capabilities=["8.0", "9.0"]) == []
    assert validate(bf16, 2, accelerator="cuda", capabilities=[None]) == []  # unknown: DeepSpeed will say


def test_supported_dtypes_follow_the_accelerator_and_the_capabilities():
    assert dsconfig.supported_dtypes("cpu") == {"fp32", "bf16"}
    assert dsconfig.supported_dtypes("cuda", ["7.5"]) == {"fp32", "fp16"}
    assert dsconfig.supported_dtypes("cuda", ["8.6"]) == {"fp32", "fp16", "bf16"}


def test_fp16_and_bf16_together_are_refused():
    _one(validate({"train_micro_batch_size_per_gpu": 8, "fp16": {"enabled": True}, "bf16": {"enabled": True}}, 2,
                  accelerator="cuda"), "both enabled")


def test_disabled_sections_are_not_problems():
    assert validate({"train_micro_batch_size_per_gpu": 8, "fp16": {"enabled": False}}, 2, accelerator="cpu") == []


# --------------------------------------------------------------------------------------------- keys, ZeRO, optimizer


def test_unknown_top_level_key_suggests_the_right_spelling():
    msg = _one(validate({"train_micro_batch_size_per_gpu": 8, "zero_optimisation": {"stage": 2}}, 2,
                        accelerator="cpu"), "unknown top-level key")
    assert "'zero_optimisation'" in msg and "silently ignore" in msg and "did you mean 'zero_optimization'" in msg


def test_unknown_zero_key_suggests_the_right_spelling():
    msg = _one(validate({"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 2, "ofload_optimizer":
                         {"device": "cpu"}}}, 2, accelerator="cpu"), "zero_optimization.")
    assert "did you mean 'offload_optimizer'" in msg


@pytest.mark.parametrize("stage", [4, -1, "2", 1.5, None])
def test_stage_outside_0_to_3_is_refused(stage):
    _one(validate({"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": stage}}, 2,
                  accelerator="cpu"), "must be 0, 1, 2 or 3")


def test_offload_optimizer_needs_stage_1():
    msg = _one(validate({"train_micro_batch_size_per_gpu": 8, "zero_optimization": {
        "stage": 0, "offload_optimizer": {"device": "cpu"}}}, 2, accelerator="cpu"), "offload_optimizer")
    assert "needs stage >= 1" in msg and "set zero_optimization.stage to 1 or higher" in msg


def test_offload_param_needs_stage_3():
    msg = _one(validate({"train_micro_batch_size_per_gpu": 8, "zero_optimization": {
        "stage": 2, "offload_param": {"device": "cpu"}}}, 2, accelerator="cpu"), "offload_param")
    assert "needs stage >= 3" in msg and "set zero_optimization.stage to 3" in msg


def test_offload_to_device_none_needs_no_stage():
    assert validate({"train_micro_batch_size_per_gpu": 8, "zero_optimization": {
        "stage": 0, "offload_optimizer": {"device": "none"}}}, 2, accelerator="cpu") == []


@pytest.mark.parametrize("device, hint", [("CPU", "did you mean 'cpu'"), ("gpu", '"cpu" is main memory'),
                                          ("disk", 'use "cpu", "nvme" or "none"')])
def test_offload_device_names_are_checked(device, hint):
    msg = _one(validate({"train_micro_batch_size_per_gpu": 8, "zero_optimization": {
        "stage": 3, "offload_param": {"device": device}}}, 2, accelerator="cpu"), "offload_param.device")
    assert hint in msg


def test_nvme_offload_needs_a_path():
    _one(validate({"train_micro_batch_size_per_gpu": 8, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "nvme"}}}, 2, accelerator="cpu"), "nvme_path is missing")


@pytest.mark.parametrize("clip", [-1.0, "1.0", True])
def test_gradient_clipping_must_be_a_non_negative_number(clip):
    _one(validate({"train_micro_batch_size_per_gpu": 8, "gradient_clipping": clip}, 2, accelerator="cpu"),
         "gradient_clipping")


def test_unknown_optimizer_and_scheduler_names_are_refused():
    problems = validate({"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamX"},
                         "scheduler": {"type": "WarmUpLR"}}, 2, accelerator="cpu")
    assert "did you mean 'Adam" in _one(problems, "optimizer.type")
    assert "did you mean 'WarmupLR'" in _one(problems, "scheduler.type")
    assert validate({"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                     "scheduler": {"type": "StepLR"}}, 2, accelerator="cpu") == []  # torch.optim names work too


def test_check_raises_one_config_error_listing_every_problem():
    bad = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 32, "gradient_accumulation_steps": 2,
           "fp16": {"enabled": True}, "zero_optimization": {"stage": 5}, "gradient_clipping": -1}
    with pytest.raises(ValueError) as info:
        check(bad, 2, accelerator="cpu")
    assert isinstance(info.value, ConfigError) and len(info.value.problems) == 4
    assert "4 problem(s)" in str(info.value)
    assert check(build(world_size=2, accelerator="cpu"), 2, accelerator="cpu") is None


def test_not_a_dict_is_refused():
    assert "JSON object" in validate(["train_batch_size", 8], 2, accelerator="cpu")[0]


# --------------------------------------------------------------------------------------------- in step with DeepSpeed


def test_key_lists_are_read_off_the_installed_deepspeed():
    """known_keys records what DeepSpeedConfig looks up, zero_keys is DeepSpeed's ZeRO model: both hold the keys
    every config in this course uses, and neither holds a typo DeepSpeed would ignore."""
    keys = FACTS.known_keys
    assert {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "zero_optimization",
            "optimizer", "scheduler", "bf16", "fp16", "gradient_clipping", "comms_logger",
            "zero_allow_untested_optimizer"} <= keys
    assert "zero_optimisation" not in keys and "train_batch" not in keys
    assert {"stage", "offload_optimizer", "offload_param", "reduce_bucket_size", "allgather_bucket_size",
            "stage3_prefetch_bucket_size"} <= FACTS.zero_keys
    assert {"adam", "adamw"} <= FACTS.optimizers and "WarmupLR" in FACTS.schedulers
    assert {"SGD", "AdamW"} <= FACTS.torch_optimizers and "StepLR" in FACTS.torch_schedulers
    assert deepspeed_facts.facts() is FACTS  # read once per process


def test_reading_the_facts_leaves_deepspeeds_dist_as_it_was():
    import deepspeed.runtime.config as ds_config
    before = ds_config.dist
    deepspeed_facts.facts.cache_clear()
    try:
        assert deepspeed_facts.facts() == FACTS
    finally:
        assert ds_config.dist is before


def test_the_checks_need_no_deepspeed_only_its_facts():
    facts = DeepSpeedFacts(known_keys=frozenset({"train_micro_batch_size_per_gpu", "optimizer", "zero_optimization"}),
                           zero_keys=frozenset({"stage"}), optimizers=frozenset({"adam"}),
                           schedulers=frozenset(), torch_optimizers=frozenset({"SGD"}))
    config = {"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "Adam"}, "zero_optimization": {"stage": 1}}
    assert dsconfig.validate(config, 2, accelerator="cpu", facts=facts) == []
    assert dsconfig.validate({**config, "optimizer": {"type": "SGD"}}, 2, accelerator="cpu", facts=facts) == []
    problems = dsconfig.validate({**config, "fp16": {"enabled": True}, "zero_optimization": {"stag": 1}}, 2,
                                 accelerator="cpu", facts=facts)
    assert any("unknown top-level key 'fp16'" in p for p in problems), problems
    assert any("zero_optimization.'stag'" in p and "did you mean 'stage'" in p for p in problems), problems


def test_the_adapter_fills_in_this_process_for_the_calculations():
    config = {"train_micro_batch_size_per_gpu": 8, "zero_optimisation": {"stage": 2}}
    assert deepspeed_facts.validate_config(config, 2, accelerator="cpu") == validate(config, 2, accelerator="cpu")
    assert deepspeed_facts.validate_config(config, 2) == validate(config, 2, accelerator=deepspeed_facts.accelerator())
    with pytest.raises(ConfigError, match="zero_optimisation"):
        deepspeed_facts.check_config(config, 2, accelerator="cpu")
    assert deepspeed_facts.check_config(build(world_size=2, accelerator="cpu"), 2, accelerator="cpu") is None
    assert deepspeed_facts.build_config(stage=1, world_size=2, accelerator="cpu") == build(stage=1, world_size=2,
                                                                                           accelerator="cpu")


def test_override_replaces_stage_and_precision_and_keeps_the_rest():
    original = {"train_micro_batch_size_per_gpu": 8, "bfloat16": {"enabled": True},
                "fp16": {"enabled": False, "initial_scale_power": 12}, "zero_optimization": {"stage": 0,
                                                                                          "overlap_comm": True}}
    out = dsconfig.override(original, stage=3, dtype="fp16")
    assert out["zero_optimization"] == {"stage": 3, "overlap_comm": True}
    assert out["fp16"] == {"enabled": True, "initial_scale_power": 12} and out["bf16"] == {"enabled": False}
    assert "bfloat16" not in out and original["zero_optimization"]["stage"] == 0  # a copy
    assert dsconfig.override(original) == original
    with pytest.raises(ConfigError, match="use one of fp32, bf16, fp16"):
        dsconfig.override(original, dtype="int8")


def test_course_ds_config_file_is_valid_for_any_world_size():
    """course/ds_config.json (the terminal example) leaves train_batch_size to DeepSpeed, so it fits any GPU count."""
    from pathlib import Path
    path = Path(__file__).resolve().parent.parent / "course" / "ds_config.json"
    config = dsconfig.load(path)
    assert "train_batch_size" not in config
    for world_size in (1, 2, 8):
        assert validate(config, world_size, accelerator="cpu") == []
