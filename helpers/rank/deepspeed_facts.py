"""What the installed DeepSpeed and torch say, for the pure calculations that must not import them.

:mod:`helpers.calc.dsconfig` checks a ds_config against what DeepSpeed accepts, and :mod:`helpers.calc.memory`
parses DeepSpeed's memory estimate; neither imports torch or DeepSpeed. This adapter asks them:

* :func:`facts` -- a :class:`~helpers.calc.dsconfig.DeepSpeedFacts`: every top-level key DeepSpeed reads (recorded
  while its own ``DeepSpeedConfig`` parses a minimal config), the fields of its ZeRO model, the optimizer and
  scheduler names it builds itself, and the torch.optim / lr_scheduler class names. Read once per process.
* :func:`accelerator` and :func:`capabilities` -- this process's device, counted without initialising CUDA
  (inside a rank where CUDA is initialised, its compute capabilities too).
* :func:`check_config`, :func:`validate_config`, :func:`build_config` -- the calc functions with those filled in.
  The DeepSpeed course scripts call ``check_config(config, world_size)`` inside every rank.
* :func:`deepspeed_estimate` -- DeepSpeed's own ZeRO-2/3 model-state estimator, its printed table captured.

Importable on both sides: by the ranks, the launcher and the notebook helpers. It never sets ``DS_ACCELERATOR``:
inside a rank the launcher (``helpers.launch.environment.rank_env``) or the learner's shell chose it, and the
notebook kernel's entry point (``helpers/notebook/__init__.py``) sets ``cpu`` for the kernel's own DeepSpeed
imports, so that they never pick CUDA there.

Example::

    from helpers.rank.deepspeed_facts import check_config, facts
    "zero_optimization" in facts().known_keys      # True
    check_config(config, world_size)               # None, or ConfigError listing every problem
"""
from __future__ import annotations

import contextlib
import functools
import io
import os
from typing import Mapping

from ..calc import dsconfig, memory


@contextlib.contextmanager
def _replaced(owner, name: str, value):
    """``owner.name`` is ``value`` inside the block and what it was before afterwards."""
    before = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, before)


class _OneRank:
    """Stands in for torch.distributed while DeepSpeedConfig is read outside a job (it asks for the world size)."""

    def is_initialized(self):
        return False

    def get_rank(self, *args, **kwargs):
        return 0

    def get_world_size(self, *args, **kwargs):
        return 1


class _Recording(dict):
    """A config dict that remembers every key read from it."""

    def __init__(self, data, seen):
        super().__init__(data)
        self.seen = seen

    def __getitem__(self, k):
        self.seen.add(k)
        return dict.__getitem__(self, k)

    def get(self, k, default=None):
        self.seen.add(k)
        return dict.get(self, k, default)

    def __contains__(self, k):
        self.seen.add(k)
        return dict.__contains__(self, k)

    def keys(self):  # DeepSpeedConfig also asks `"optimizer" in config.keys()`
        return _RecordingKeys(self)


class _RecordingKeys:
    def __init__(self, config: _Recording):
        self.config = config

    def __contains__(self, k):
        self.config.seen.add(k)
        return dict.__contains__(self.config, k)

    def __iter__(self):
        return iter(dict.keys(self.config))

    def __len__(self):
        return len(self.config)


def _known_keys() -> frozenset[str]:
    """Every top-level key the installed DeepSpeed reads: recorded while its own ``DeepSpeedConfig`` parses a
    minimal config, so a DeepSpeed upgrade that adds keys is known without a list kept by hand."""
    import deepspeed.runtime.config as ds_config

    seen: set = set()
    with _replaced(ds_config, "dist", _OneRank()):
        ds_config.DeepSpeedConfig(_Recording({"train_micro_batch_size_per_gpu": 1}, seen))
    return frozenset(k for k in seen if isinstance(k, str))


def _classes(module) -> frozenset[str]:
    return frozenset(n for n in dir(module) if isinstance(getattr(module, n), type))


@functools.lru_cache(maxsize=1)
def facts() -> dsconfig.DeepSpeedFacts:
    """What the installed DeepSpeed and torch accept in a ds_config (computed once per process)."""
    import torch
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS
    from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    return dsconfig.DeepSpeedFacts(
        known_keys=_known_keys(),
        zero_keys=frozenset(f.alias or name for name, f in DeepSpeedZeroConfig.model_fields.items()),
        optimizers=frozenset(n.lower() for n in DEEPSPEED_OPTIMIZERS),
        schedulers=frozenset(VALID_LR_SCHEDULES),
        torch_optimizers=_classes(torch.optim),
        torch_schedulers=_classes(torch.optim.lr_scheduler))


def accelerator() -> str:
    """``"cuda"`` when this process sees GPUs, else ``"cpu"`` (counted without initialising CUDA)."""
    import torch
    return "cuda" if torch.cuda.device_count() > 0 else "cpu"


def capabilities() -> list[str] | None:
    """Compute capability ("8.0", ...) of each visible GPU where CUDA is already initialised (inside a rank), else
    None: unknown, which does not block bf16. The notebook kernel never initialises CUDA; its launcher asks a
    subprocess instead (:func:`helpers.launch.machine.cuda_capabilities`)."""
    import torch
    if not torch.cuda.is_initialized():
        return None
    return ["{}.{}".format(*torch.cuda.get_device_capability(i)) for i in range(torch.cuda.device_count())]


def _here(kw: dict) -> dict:
    """``kw`` with this process's accelerator, capabilities and DeepSpeed's facts where the caller left them out."""
    if kw.get("accelerator") is None:
        kw["accelerator"] = accelerator()
    if "capabilities" not in kw and kw["accelerator"] == "cuda":
        kw["capabilities"] = capabilities()
    if kw.get("facts") is None:
        kw["facts"] = facts()
    return kw


def check_config(config: Mapping | str | os.PathLike, world_size: int, **kw) -> None:
    """:func:`helpers.calc.dsconfig.check` with the accelerator, capabilities and DeepSpeed facts of this process
    filled in (any of them may still be passed). Raises :class:`~helpers.calc.dsconfig.ConfigError`.

    Example (inside a rank, on the final config)::

        check_config(config, dist.get_world_size())
    """
    dsconfig.check(config, world_size, **_here(kw))


def validate_config(config: Mapping, world_size: int | None, **kw) -> list[str]:
    """:func:`helpers.calc.dsconfig.validate` with this process's accelerator and DeepSpeed's facts filled in."""
    return dsconfig.validate(config, world_size, **_here(kw))


def build_config(**kw) -> dict:
    """:func:`helpers.calc.dsconfig.build` with this process's accelerator and DeepSpeed's facts filled in.

    Example::

        build_config(stage=2, dtype="bf16", micro_batch=16, accumulation=2, world_size=2)["train_batch_size"]  # 64
    """
    return dsconfig.build(**_here(kw))


def deepspeed_estimate(params: int, num_gpus_per_node: int, num_nodes: int = 1, stage: int = 2, *,
                       largest_layer_params: int | None = None, additional_buffer_factor: float = 1.5) -> dict:
    """DeepSpeed's own model-state estimate for ZeRO stage 2 or 3, one row per offload option.

    Runs ``estimate_zero2_model_states_mem_needs_all_cold`` / ``estimate_zero3_..._all_cold`` (they print),
    captures the table, and returns ``{"text": <what it printed>, "rows": [...]}``. Each row has ``options``
    (offload_optimizer, and for stage 3 offload_param and zero_init), the printed ``per_cpu_gib``/``per_gpu_gib``
    (:func:`helpers.calc.memory.parse_estimate`), and the unrounded ``per_cpu_bytes``/``per_gpu_bytes`` from the same
    DeepSpeed function the printer calls.

    DeepSpeed's GPU column is not the paper's: without offload it charges 2P + 18P/N at stage 2 (the 18 adds an fp32
    gradient copy, 4 bytes, to the paper's 2 + 12) and 4 x largest layer + 18P/N at stage 3 (room to gather the
    biggest layer). Its CPU column is host memory for loading/offload, scaled by ``additional_buffer_factor``.
    The estimators are arithmetic; importing them in the notebook kernel picks DeepSpeed's CPU accelerator there
    (``DS_ACCELERATOR``, set by the kernel's entry point).

    Example::

        est = deepspeed_estimate(20_000_000, num_gpus_per_node=2, stage=3, largest_layer_params=6_500_000)
        print(est["text"]); est["rows"][-1]["per_gpu_bytes"]
    """
    if stage not in (2, 3):
        raise ValueError(f"DeepSpeed has estimators for stage 2 and 3 only, got stage={stage!r}")
    if stage == 3 and largest_layer_params is None:
        raise ValueError("stage 3 needs largest_layer_params (parameters of the biggest module; "
                         "helpers.calc.memory.largest_layer_params(model) counts them)")
    kw = dict(total_params=params, num_gpus_per_node=num_gpus_per_node, num_nodes=num_nodes,
              additional_buffer_factor=additional_buffer_factor)
    buf = io.StringIO()
    if stage == 2:
        from deepspeed.runtime.zero.stage_1_and_2 import (estimate_zero2_model_states_mem_needs as exact,
                                                          estimate_zero2_model_states_mem_needs_all_cold as show)
    else:
        from deepspeed.runtime.zero.stage3 import (estimate_zero3_model_states_mem_needs as exact,
                                                   estimate_zero3_model_states_mem_needs_all_cold as show)
        kw["largest_layer_params"] = largest_layer_params
    with contextlib.redirect_stdout(buf):
        show(**kw)
    rows = memory.parse_estimate(buf.getvalue())
    for row in rows:
        opts = row["options"]
        extra = {"cpu_offload": opts.get("offload_optimizer") == "cpu"}
        if stage == 3:
            extra.update(cpu_offload_params=opts.get("offload_param") == "cpu", zero_init=bool(opts.get("zero_init")))
        cpu, gpu = exact(**kw, **extra)[:2]
        row.update(per_cpu_bytes=cpu, per_gpu_bytes=gpu)
    return {"text": buf.getvalue(), "rows": rows}
