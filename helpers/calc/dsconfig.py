"""Build DeepSpeed configs from a few choices, and check them before launch.

DeepSpeed reads its settings from a JSON "ds_config". Two things make a wrong config costly to find: DeepSpeed
ignores top-level keys it does not know (a typo such as ``"zero_optimisation"`` silently runs without ZeRO), and
the mistakes it does catch surface as an ``AssertionError`` or a pydantic dump from inside every rank, after the
launch. :func:`validate` finds them first and says what to change.

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

import difflib
import json
import numbers
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

DTYPES = ("fp32", "bf16", "fp16")
OFFLOAD_CHOICES = (None, "optimizer", "param", "both")
OFFLOAD_DEVICES = ("cpu", "nvme", "none")


@dataclass(frozen=True)
class DeepSpeedFacts:
    """What the installed DeepSpeed (and torch) accept in a ds_config, as plain data.

    ``known_keys``: every top-level key DeepSpeed reads (it ignores the others silently). ``zero_keys``: the fields
    of its ZeRO model (it rejects the others). ``optimizers``: the optimizer names it builds itself, in lower case
    (it matches them in any case); ``schedulers``: its LR scheduler names (matched exactly). ``torch_optimizers`` /
    ``torch_schedulers``: the class names of ``torch.optim`` / ``torch.optim.lr_scheduler``, which a config's
    "type" may name too. Read off the installed packages by :func:`helpers.rank.deepspeed_facts.facts`.
    """

    known_keys: frozenset[str]
    zero_keys: frozenset[str]
    optimizers: frozenset[str]
    schedulers: frozenset[str]
    torch_optimizers: frozenset[str] = frozenset()
    torch_schedulers: frozenset[str] = frozenset()


class ConfigError(ValueError):
    """A ds_config that would fail (or silently misbehave) at launch. ``problems`` lists each message."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"DeepSpeed config has {len(self.problems)} problem(s):\n{lines}")


def supported_dtypes(accelerator: str, capabilities: list[str] | None = None) -> set[str]:
    """Training precisions this course runs on ``accelerator``.

    CPU: fp32 and bf16. DeepSpeed's CPU accelerator reports fp16 only where oneDNN has fp16 kernels; the course
    trains CPUs in bf16, which stores the same 2 bytes and needs no loss scaler.
    CUDA: fp32 and fp16 everywhere, bf16 on compute capability 8.0+ (Ampere and later), judged from the
    ``capabilities`` ("8.0", ...) of the GPUs: inside a rank :func:`helpers.rank.deepspeed_facts.capabilities`
    asks CUDA, in the notebook kernel, which never initialises CUDA, a subprocess probe
    (:func:`helpers.launch.machine.cuda_capabilities`) does. Unknown capabilities (None) do not block bf16
    (DeepSpeed will say).
    """
    if accelerator == "cpu":
        return {"fp32", "bf16"}
    out = {"fp32", "fp16"}
    caps = capabilities or []
    if all(c is None or float(c) >= 8.0 for c in caps):
        out.add("bf16")
    return out


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


def _suggest(key: str, known) -> str:
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _is_count(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def batch_sizes(config: Mapping, world_size: int) -> dict:
    """Resolve the three batch numbers the way DeepSpeed does (it derives a missing one by integer division).

    Returns ``train_batch_size``, ``micro_batch`` (per rank), ``accumulation``, ``world_size`` and ``given``
    (which of them the config set), and ``explanation``, one line a learner can read.

    Example::

        batch_sizes({"train_batch_size": 64, "gradient_accumulation_steps": 2}, 2)["explanation"]
        # 'train_batch_size 64 = 16 (micro batch per rank) x 2 (accumulation steps) x 2 (ranks)'
    """
    tbs, micro, ga = (config.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                               "gradient_accumulation_steps"))
    given = [k for k, v in (("train_batch_size", tbs), ("train_micro_batch_size_per_gpu", micro),
                            ("gradient_accumulation_steps", ga)) if v is not None]
    if tbs is not None and micro is not None and ga is None:
        ga = tbs // micro // world_size
    elif tbs is not None and ga is not None and micro is None:
        micro = tbs // world_size // ga
    elif micro is not None and tbs is None:
        ga = 1 if ga is None else ga
        tbs = micro * ga * world_size
    elif tbs is not None and micro is None:
        ga, micro = 1, tbs // world_size
    explanation = (f"train_batch_size {tbs} = {micro} (micro batch per rank) x {ga} (accumulation steps) "
                   f"x {world_size} (ranks)")
    return {"train_batch_size": tbs, "micro_batch": micro, "accumulation": ga, "world_size": world_size,
            "given": given, "explanation": explanation}


def _batch_problems(config: Mapping, world_size: int) -> list[str]:
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    bad = [f"{k} must be a whole number >= 1, got {config[k]!r}" for k in keys
           if k in config and not (_is_count(config[k]) and config[k] >= 1)]
    if bad:
        return bad
    tbs, micro, ga = (config.get(k) for k in keys)
    if tbs is None and micro is None:
        return ["set train_micro_batch_size_per_gpu (samples per rank per step); DeepSpeed then derives "
                "train_batch_size = micro batch x gradient_accumulation_steps x world_size"]
    r = batch_sizes(config, world_size)
    if r["micro_batch"] < 1 or r["accumulation"] < 1:
        return [f"train_batch_size {tbs} is too small for {world_size} ranks"
                + (f" x {ga} accumulation steps" if ga else "") + f": each rank needs at least 1 sample per "
                f"micro batch; set train_batch_size to at least {world_size * (ga or 1)}"]
    product = r["micro_batch"] * r["accumulation"] * world_size
    if product == r["train_batch_size"]:
        return []
    m, g, n = r["micro_batch"], r["accumulation"], world_size
    msg = (f"batch arithmetic: train_batch_size must equal train_micro_batch_size_per_gpu x "
           f"gradient_accumulation_steps x world_size, but {m} x {g} x {n} = {product}, not {tbs}.")
    if len(r["given"]) == 3:
        if tbs == m * n and g > 1:
            msg += (f" ('{n} x {m} = {tbs}' forgets gradient_accumulation_steps={g}: each optimizer step sees "
                    f"{g} micro batches per rank.)")
        elif tbs == m * g and n > 1:
            msg += f" ('{m} x {g} = {tbs}' forgets that each of the {n} ranks runs its own micro batches.)"
        fixes = []
        if tbs % (g * n) == 0:
            fixes.append(f"train_micro_batch_size_per_gpu to {tbs // (g * n)} (keeps {tbs} samples per step)")
        fixes.append(f"train_batch_size to {product} (keeps micro batch {m})")
        if tbs % (m * n) == 0:
            fixes.append(f"gradient_accumulation_steps to {tbs // (m * n)}")
        msg += " Set " + ", or ".join(fixes) + "."
    else:
        msg += (f" DeepSpeed would round the missing value down; pick a train_batch_size divisible by "
                f"{n * (ga or micro or 1)}, or set train_micro_batch_size_per_gpu and gradient_accumulation_steps "
                f"and leave train_batch_size out.")
    return [msg]


def _enabled(section) -> bool:
    return isinstance(section, Mapping) and bool(section.get("enabled", False))


def _precision_problems(config: Mapping, accelerator: str, capabilities: list[str] | None) -> list[str]:
    out = []
    fp16, bf16 = _enabled(config.get("fp16")), _enabled(config.get("bf16")) or _enabled(config.get("bfloat16"))
    if fp16 and bf16:
        return ["fp16 and bf16 are both enabled; enable one of them (or neither, for fp32)"]
    ok = supported_dtypes(accelerator, capabilities)
    if fp16 and "fp16" not in ok:
        out.append('fp16 is enabled but DeepSpeed runs on the CPU here, where this course trains in bf16 (the same '
                   '2 bytes, and no loss scaler): set '
                   '"bf16": {"enabled": true} (or no precision section, for fp32) instead of "fp16"')
    if bf16 and "bf16" not in ok:
        out.append('bf16 is enabled but this GPU does not support it (needs compute capability 8.0+, Ampere '
                   'or later): use "fp16": {"enabled": true} or fp32')
    return out


def _zero_problems(config: Mapping, facts: DeepSpeedFacts) -> list[str]:
    zero = config.get("zero_optimization", {})
    if not isinstance(zero, Mapping):
        return [f'zero_optimization must be an object such as {{"stage": 2}}, got {zero!r}']
    out = [f"unknown key zero_optimization.{k!r} (DeepSpeed rejects it){_suggest(k, facts.zero_keys)}"
           for k in zero if k not in facts.zero_keys]
    stage = zero.get("stage", 0)
    if not (_is_count(stage) and 0 <= stage <= 3):
        out.append(f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
        stage = None
    for key, needs, what in (("offload_optimizer", 1, "optimizer state lives in ZeRO partitions from stage 1"),
                             ("offload_param", 3, "only stage 3 partitions the parameters themselves")):
        section = zero.get(key)
        if section is None:
            continue
        if not isinstance(section, Mapping):
            out.append(f'zero_optimization.{key} must be an object such as {{"device": "cpu"}}, got {section!r}')
            continue
        device = section.get("device", "none")
        if device not in OFFLOAD_DEVICES:
            hint = ' ("cpu" is main memory)' if str(device).lower() in ("gpu", "cuda", "ram", "host") else ""
            out.append(f"zero_optimization.{key}.device is {device!r}: use \"cpu\", \"nvme\" or \"none\"{hint}"
                       f"{_suggest(str(device).lower(), OFFLOAD_DEVICES)}")
        elif device == "nvme" and not section.get("nvme_path"):
            out.append(f'zero_optimization.{key}.device is "nvme" but nvme_path is missing: add "nvme_path": '
                       f'"/path/on/a/fast/local/disk"')
        if device != "none" and stage is not None and stage < needs:
            out.append(f"zero_optimization.{key} needs stage >= {needs} ({what}), but stage is {stage}: "
                       f"set zero_optimization.stage to {needs}{'' if needs == 3 else ' or higher'}, or remove {key}")
    return out


def _optimizer_problems(config: Mapping, facts: DeepSpeedFacts) -> list[str]:
    out = []  # DeepSpeed's own names, and any torch.optim / torch.optim.lr_scheduler class name
    for key, known, torch_names in (("optimizer", facts.optimizers, facts.torch_optimizers),
                                    ("scheduler", facts.schedulers, facts.torch_schedulers)):
        section = config.get(key)
        if section is None:
            continue
        example = "AdamW" if key == "optimizer" else "WarmupLR"
        if not isinstance(section, Mapping) or "type" not in section:
            out.append(f'{key} must be an object with a "type", such as {{"type": "{example}", "params": {{}}}}')
            continue
        name = str(section["type"])
        # DeepSpeed matches its optimizer names in any case, scheduler names exactly
        ours = name.lower() in known if key == "optimizer" else name in known
        if not ours and name not in torch_names:
            public = [n for n in torch_names if n[0].isupper()]
            attr = "optim" if key == "optimizer" else "optim.lr_scheduler"
            out.append(f"{key}.type {name!r} is neither a DeepSpeed {key} ({', '.join(sorted(known))}) nor a "
                       f"torch.{attr} class{_suggest(name, [*known, *public])}")
    return out


def validate(config: Mapping, world_size: int | None, *, accelerator: str, capabilities: list[str] | None = None,
             facts: DeepSpeedFacts) -> list[str]:
    """Every problem with ``config`` for a run on ``world_size`` ranks, as messages that say what to change.

    Checks: unknown top-level keys (DeepSpeed ignores them silently) with a "did you mean"; the batch rule
    (skipped when ``world_size`` is None); fp16/bf16 against ``accelerator`` ("cpu" or "cuda"; on "cuda",
    ``capabilities`` as in :func:`supported_dtypes`); ZeRO stage 0-3, unknown zero keys, offload/stage combinations
    and offload devices; optimizer and scheduler names; a negative gradient_clipping. An empty list means none found.
    ``facts``: what the installed DeepSpeed accepts (:class:`DeepSpeedFacts`).

    Example::

        validate({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 32,
                  "gradient_accumulation_steps": 2}, world_size=2, accelerator="cpu", facts=deepspeed_facts.facts())
        # ["batch arithmetic: ... 32 x 2 x 2 = 128, not 64. ('2 x 32 = 64' forgets gradient_accumulation_steps=2 ...)"]
    """
    if not isinstance(config, Mapping):
        return [f"a ds_config is a JSON object (dict), got {type(config).__name__}"]
    out = [f"unknown top-level key {k!r} (DeepSpeed would silently ignore it){_suggest(k, facts.known_keys)}"
           for k in config if k not in facts.known_keys]
    if world_size is not None:
        if not (_is_count(world_size) and world_size >= 1):
            out.append(f"world_size must be a whole number >= 1, got {world_size!r}")
        else:
            out += _batch_problems(config, world_size)
    out += _precision_problems(config, accelerator, capabilities)
    out += _zero_problems(config, facts)
    out += _optimizer_problems(config, facts)
    clip = config.get("gradient_clipping")
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, numbers.Real) or clip < 0):
        out.append(f"gradient_clipping is the largest allowed global gradient norm: a number >= 0 (0 turns it "
                   f"off), got {clip!r}")
    return out


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
