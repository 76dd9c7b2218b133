"""One definition of the metric fields: every field the training scripts report is one of helpers.rank.metrics'
TrainStep / TrainResult fields, and what the rank-side measuring functions return uses those names."""
import ast
from pathlib import Path
from typing import get_type_hints

import pytest
import torch

from helpers.rank import metrics, state

ROOT = Path(__file__).resolve().parent.parent
TRAINING_SCRIPTS = ["ddp_cifar10.py", "ds_cifar10.py", "ddp_tuning.py", "ds_tuning.py", "elastic_cifar10.py"]
STEP_FIELDS = set(get_type_hints(metrics.TrainStep))
RESULT_FIELDS = set(get_type_hints(metrics.TrainResult))


def _reported(script: str) -> dict[str, set[str]]:
    """Keyword names passed to rep.step(...) and rep.result(...) in a script; ** of a measuring call is expanded by
    the functions' own tests below."""
    found = {"step": set(), "result": set()}
    for node in ast.walk(ast.parse((ROOT / "course" / script).read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in found \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "rep":
            found[node.func.attr] |= {k.arg for k in node.keywords if k.arg is not None}
    return found


@pytest.mark.parametrize("script", TRAINING_SCRIPTS)
def test_training_scripts_report_only_fields_of_the_schema(script):
    fields = _reported(script)
    assert fields["step"] or fields["result"], f"{script} reports nothing through rep.step/rep.result"
    assert fields["step"] <= STEP_FIELDS, sorted(fields["step"] - STEP_FIELDS)
    assert fields["result"] <= RESULT_FIELDS, sorted(fields["result"] - RESULT_FIELDS)


def test_memory_readings_use_the_schemas_names():
    assert set(state.memory_now(torch.device("cpu"))) <= STEP_FIELDS
    assert set(state.peak_memory(torch.device("cpu"))) <= RESULT_FIELDS


def test_old_spellings_of_the_same_quantity_are_gone():
    old = ("cuda_peak_mb", "peak_cuda_mb", "peak_rss_mb", "rss_start_mb", "\"rss_mb\"")
    for path in [*(ROOT / "course").glob("*.py"), *(ROOT / "helpers").rglob("*.py")]:
        text = path.read_text()
        assert not [o for o in old if o in text], path
