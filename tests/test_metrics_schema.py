"""One definition of the metric fields: the Reporter refuses any field outside helpers.rank.metrics' TrainStep /
TrainResult (tests/test_harness.py shows it refusing), every training script reports through a checked Reporter, and
what the rank-side measuring functions return uses the schema's names."""
from pathlib import Path
from typing import get_type_hints

import torch

from helpers.rank import harness, metrics, state

ROOT = Path(__file__).resolve().parent.parent
STEP_FIELDS = set(get_type_hints(metrics.TrainStep))
RESULT_FIELDS = set(get_type_hints(metrics.TrainResult))


def test_memory_readings_use_the_schemas_names():
    assert set(state.memory_now(torch.device("cpu"))) <= STEP_FIELDS
    assert set(state.peak_memory(torch.device("cpu"))) <= RESULT_FIELDS


def test_the_meters_summary_uses_the_schemas_names():
    summary = {"train_seconds", "first_step_s", "samples_per_s", "timed_steps", "train_samples"}
    source = Path(harness.__file__).read_text()
    assert all(f"{name}=" in source for name in summary)
    assert summary <= RESULT_FIELDS


def test_every_schema_field_says_what_it_is():
    source = Path(metrics.__file__).read_text()
    for name in STEP_FIELDS | RESULT_FIELDS:
        line = next(l for l in source.splitlines() if l.strip().startswith(f"{name}:"))
        assert "#" in line, f"{name} has no comment with its meaning and unit"


def test_old_spellings_of_the_same_quantity_are_gone():
    old = ("cuda_peak_mb", "peak_cuda_mb", "peak_rss_mb", "rss_start_mb", "\"rss_mb\"")
    for path in [*(ROOT / "course").glob("*.py"), *(ROOT / "helpers").rglob("*.py")]:
        text = path.read_text()
        assert not [o for o in old if o in text], path
