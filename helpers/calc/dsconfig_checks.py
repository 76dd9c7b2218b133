"""What is wrong with a ds_config, in messages that say what to change: the checks behind
:func:`helpers.calc.dsconfig.validate` (which :mod:`helpers.calc.dsconfig` re-exports with every other name here,
so callers keep writing ``dsconfig.validate``, ``dsconfig.batch_sizes``, ``dsconfig.DeepSpeedFacts``).

Unknown top-level keys (DeepSpeed ignores them silently), the batch rule ``train_batch_size ==
train_micro_batch_size_per_gpu x gradient_accumulation_steps x world_size`` (:func:`batch_sizes` resolves it the way
DeepSpeed does), the precision against the accelerator (:func:`supported_dtypes`), the ZeRO section and its
offloads, the optimizer and scheduler names, and the clipping norm. What the installed DeepSpeed accepts comes in
as a :class:`DeepSpeedFacts`; like :mod:`helpers.calc.dsconfig`, this module imports neither torch nor DeepSpeed.
"""
from __future__ import annotations

import difflib
import numbers
from dataclasses import dataclass
from typing import Mapping

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
