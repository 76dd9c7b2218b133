"""What the installed DeepSpeed accepts in a ds_config, read off DeepSpeed itself instead of lists kept by hand.

* :func:`known_keys` -- every top-level key DeepSpeed reads (it ignores the others silently, so a typo such as
  ``"zero_optimisation"`` runs without ZeRO): recorded while DeepSpeed's own ``DeepSpeedConfig`` parses a config.
* :func:`zero_keys` -- the fields of DeepSpeed's pydantic ZeRO model, ``DeepSpeedZeroConfig``.
* :func:`deepspeed_names` -- the optimizer and LR-scheduler names DeepSpeed builds itself.

Each is computed once per process (DeepSpeed is imported on first use, with its CPU accelerator unless one is set:
in a notebook kernel it must not pick CUDA).

Example::

    "zero_optimization" in known_keys()     # True
    "zero_optimisation" in known_keys()     # False
"""
from __future__ import annotations

import functools
import os


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


@functools.lru_cache(maxsize=1)
def known_keys() -> frozenset[str]:
    """Every top-level key the installed DeepSpeed reads: recorded while its own ``DeepSpeedConfig`` parses a
    minimal config, so a DeepSpeed upgrade that adds keys is known without a list kept by hand here."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # in a notebook kernel importing DeepSpeed must not pick CUDA
    from unittest import mock

    import deepspeed.runtime.config as ds_config

    seen: set = set()
    with mock.patch.object(ds_config, "dist", _OneRank()):
        ds_config.DeepSpeedConfig(_Recording({"train_micro_batch_size_per_gpu": 1}, seen))
    return frozenset(k for k in seen if isinstance(k, str))


@functools.lru_cache(maxsize=1)
def zero_keys() -> frozenset[str]:
    """The fields of DeepSpeed's ZeRO config model (it rejects anything else, with a pydantic error)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    return frozenset(f.alias or name for name, f in DeepSpeedZeroConfig.model_fields.items())


@functools.lru_cache(maxsize=1)
def deepspeed_names() -> tuple[frozenset[str], frozenset[str]]:
    """(optimizer names in lower case, LR scheduler names) that DeepSpeed builds itself from a config's "type"."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS
    from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES
    return frozenset(n.lower() for n in DEEPSPEED_OPTIMIZERS), frozenset(VALID_LR_SCHEDULES)
