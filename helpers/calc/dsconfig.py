"""Build DeepSpeed configs from a few choices, and check them before launch.

DeepSpeed reads its settings from a JSON "ds_config". Two things make a wrong config costly to find: DeepSpeed
ignores top-level keys it does not know (a typo such as ``"zero_optimisation"`` silently runs without ZeRO), and
the mistakes it does catch surface as an ``AssertionError`` or a pydantic dump from inside every rank, after the
launch. :func:`validate` finds them first and says what to change (the checks are in
:mod:`helpers.calc.dsconfig_checks`; this module re-exports them).

What the installed DeepSpeed accepts is read off DeepSpeed itself, not kept in lists here; this module imports
neither torch nor DeepSpeed, so it comes in as a :class:`DeepSpeedFacts` argument from
:func:`helpers.rank.deepspeed_facts.facts` (whose ``build_config``/``validate_config``/``check_config`` fill it in).

The batch rule DeepSpeed enforces::

    train_batch_size == train_micro_batch_size_per_gpu x gradient_accumulation_steps x world_size

``train_batch_size`` is the number of samples behind one optimizer step, across all ranks. A classic slip
(made in the blog post this course started from): ``train_batch_size: 64`` with ``gradient_accumulation_steps: 2``
on 2 GPUs described as "2 x 32 = 64". That product forgets the accumulation: the micro batch is 64 / (2 x 2) = 16.

Example::

    facts = helpers.rank.deepspeed_facts.facts()
    cfg = build(stage=2, dtype="bf16", micro_batch=16, accumulation=2, world_size=2, warmup_steps=50, clip=1.0,
                accelerator="cpu", facts=facts)
    cfg["train_batch_size"]                                   # 64
    check(cfg, world_size=2, accelerator="cpu", facts=facts)  # None, or ConfigError listing every problem
    save(cfg, "runs/ds_config.json")
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

# the checks (validate and the batch rule) live in dsconfig_checks.py; callers use them through this module
from .dsconfig_checks import (OFFLOAD_DEVICES, DeepSpeedFacts, batch_sizes, supported_dtypes,  # noqa: F401
                              validate)

DTYPES = ("fp32", "bf16", "fp16")
OFFLOAD_CHOICES = (None, "optimizer", "param", "both")


class ConfigError(ValueError):
    """A ds_config that would fail (or silently misbehave) at launch. ``problems`` lists each message."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"DeepSpeed config has {len(self.problems)} problem(s):\n{lines}")


# --------------------------------------------------------------------------------------------- build


def build(stage: int = 0, dtype: str = "fp32", micro_batch: int = 32, accumulation: int = 1,
          world_size: int | None = None, optimizer: str = "AdamW", lr: float = 1e-3, warmup_steps: int = 0,
          clip: float | None = None, offload: str | None = None, *, weight_decay: float = 0.0,
          torch_adam: bool = True, zero: Mapping[str, Any] | None = None,
          accelerator: str, capabilities: list[str] | None = None, facts: DeepSpeedFacts) -> dict:
    """A ds_config dict from a few choices; checked with :func:`validate` before it is returned.

    ``stage``: ZeRO stage 0-3. ``dtype``: "fp32", "bf16" or "fp16". ``micro_batch``: samples per rank per
    forward/backward. ``accumulation``: micro batches per optimizer step. ``world_size``: when given,
    ``train_batch_size`` is written out (micro_batch x accumulation x world_size), otherwise DeepSpeed derives it.
    ``warmup_steps`` > 0 adds a linear WarmupLR from 0 to ``lr``. ``clip``: gradient_clipping (max global norm); None writes 0.0 (off), since DeepSpeed 0.19 clips at 1.0 when the key is absent.
    ``offload``: None, "optimizer" (stage >= 1), "param" or "both" (stage 3), to CPU memory.
    ``torch_adam``: use PyTorch's Adam/AdamW instead of DeepSpeed's FusedAdam, which is JIT-compiled on first use
    (a C++/CUDA build of a minute or more, and impossible without a compiler). ``zero``: extra
    ``zero_optimization`` fields such as ``{"reduce_bucket_size": 5e6}``. ``accelerator``, ``capabilities`` and
    ``facts``: as in :func:`validate`.

    Example::

        build(stage=3, dtype="bf16", micro_batch=8, world_size=2, accelerator="cpu",
              facts=deepspeed_facts.facts())["zero_optimization"]                      # {'stage': 3}
    """
    if dtype not in DTYPES:
        raise ConfigError([f"dtype={dtype!r}: use one of {', '.join(DTYPES)}"])
    if offload not in OFFLOAD_CHOICES:
        raise ConfigError([f"offload={offload!r}: use one of {OFFLOAD_CHOICES}"])
    params: dict[str, Any] = {"lr": lr, "weight_decay": weight_decay}
    if optimizer.lower() in ("adam", "adamw") and torch_adam:
        params["torch_adam"] = True
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": accumulation,
        "optimizer": {"type": optimizer, "params": params},
        "zero_optimization": {"stage": stage, **dict(zero or {})},
    }
    if world_size is not None:
        config = {"train_batch_size": micro_batch * accumulation * world_size, **config}
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 16}
    if warmup_steps > 0:
        config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": lr,
                                                              "warmup_num_steps": warmup_steps,
                                                              "warmup_type": "linear"}}
    # DeepSpeed 0.19 clips at 1.0 when the key is absent (microsoft/DeepSpeed PR #8068), so "no clipping" is
    # written out as 0.0: what you did not ask for should not quietly change your training
    config["gradient_clipping"] = 0.0 if clip is None else clip
    if offload in ("optimizer", "both"):
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if offload in ("param", "both"):
        config["zero_optimization"]["offload_param"] = {"device": "cpu"}
    problems = validate(config, world_size, accelerator=accelerator, capabilities=capabilities, facts=facts)
    if problems:
        raise ConfigError(problems)
    return config


def override(config: Mapping, *, stage: int | None = None, dtype: str | None = None) -> dict:
    """A copy of ``config`` with the ZeRO stage and/or precision replaced (None leaves that part alone).

    What ``--stage``/``--dtype`` do in course/ds_cifar10.py; other settings of the fp16/bf16 sections are kept.

    Example::

        override({"bf16": {"enabled": True}, "zero_optimization": {"stage": 0}}, stage=3, dtype="fp32")
        # {'bf16': {'enabled': False}, 'zero_optimization': {'stage': 3}, 'fp16': {'enabled': False}}
    """
    config = json.loads(json.dumps(config))  # a deep copy; the caller's dict (or file) is untouched
    if stage is not None:
        config.setdefault("zero_optimization", {})["stage"] = stage
    if dtype is not None:
        if dtype not in DTYPES:
            raise ConfigError([f"dtype={dtype!r}: use one of {', '.join(DTYPES)}"])
        config.pop("bfloat16", None)  # the old spelling of "bf16"
        for key in ("bf16", "fp16"):
            config[key] = {**config.get(key, {}), "enabled": key == dtype}
    return config


def save(config: Mapping, path: str | os.PathLike) -> Path:
    """Write ``config`` as indented JSON (folders created); returns the path. Pass it as ``--deepspeed_config``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=2) + "\n")
    return path


def load(config: Mapping | str | os.PathLike) -> dict:
    """A config dict from a dict or a JSON file."""
    if isinstance(config, Mapping):
        return dict(config)
    try:
        return json.loads(Path(config).read_text())
    except FileNotFoundError:
        raise ConfigError([f"config file not found: {config}"]) from None
    except json.JSONDecodeError as e:
        raise ConfigError([f"{config} is not valid JSON: {e}"]) from None


# --------------------------------------------------------------------------------------------- checks


def check(config: Mapping | str | os.PathLike, world_size: int, *, accelerator: str,
          capabilities: list[str] | None = None, facts: DeepSpeedFacts) -> None:
    """Raise :class:`ConfigError` listing every problem :func:`validate` finds; return None when there are none.

    ``config`` may be a dict or a path to a JSON file. Called before launch (helpers.launch.deepspeed) and, through
    :func:`helpers.rank.deepspeed_facts.check_config`, by the DeepSpeed course scripts on their final config, so a
    learner sees these messages, not DeepSpeed's assertions.

    Example::

        check({"train_micro_batch_size_per_gpu": 32, "fp16": {"enabled": True}}, 2, accelerator="cpu",
              facts=deepspeed_facts.facts())
        # ConfigError: ... fp16 is enabled but DeepSpeed runs on the CPU here ... set "bf16": {"enabled": true} ...
    """
    problems = validate(load(config), world_size, accelerator=accelerator, capabilities=capabilities, facts=facts)
    if problems:
        raise ConfigError(problems)
