"""The harness's profiling switch (--profile-steps): every course script offers it, the Meter profiles exactly the
steady-state steps asked for and writes a Chrome trace per rank (notebook 11 reads, merges and draws real ranks'
traces under nbval)."""
from __future__ import annotations

import ast
import json

import pytest

from helpers import launch

COURSE = launch.PROJECT_ROOT / "course"


def scripts_with_a_meter():
    for path in sorted(COURSE.glob("*.py")):
        tree = ast.parse(path.read_text())
        calls = [n.func for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
        if any(f.attr == "Meter" for f in calls):
            yield path.name, {f"{getattr(f.value, 'id', '')}.{f.attr}" for f in calls}


def test_every_training_script_parses_the_shared_flags_that_carry_the_profile_switch():
    found = dict(scripts_with_a_meter())
    assert len(found) >= 10, sorted(found)  # the finder finds the scripts' meters
    without = [name for name, calls in found.items() if not {"harness.parser", "lm.parser", "harness.profile_flag"} & calls]
    assert without == []


def test_the_flag_reaches_the_meter_through_the_environment(monkeypatch):
    import torch

    from helpers.rank import harness, lm

    monkeypatch.setenv(harness.PROFILE_ENV, "")  # recorded first, so the test leaves the variable as it found it
    assert harness.Meter(5, torch.device("cpu"), 1, samples_per_step=1, skip=1).profile == 0
    for parser in (harness.parser("x"), lm.parser("x")):
        assert parser.parse_args(["--profile-steps", "3"]).profile_steps == 3
        assert harness.Meter(10, torch.device("cpu"), 1, samples_per_step=1, skip=2).profile == 3
        monkeypatch.delenv(harness.PROFILE_ENV)
        with pytest.raises(SystemExit):
            parser.parse_args(["--profile-steps", "-1"])


def test_the_meter_profiles_the_steady_steps_asked_for_and_nothing_else(tmp_path, monkeypatch):
    import torch

    from helpers.rank import harness

    monkeypatch.setenv("HELPERS_RUN_DIR", str(tmp_path))
    x = torch.randn(64, 64)
    meter = harness.Meter(7, torch.device("cpu"), 1, samples_per_step=1, skip=3, profile=2)
    for _ in meter.steps():
        with torch.profiler.record_function(f"work at step {meter.current}"):
            (x @ x).sum()
        meter.step(loss=0.0, samples=1)
    trace = json.loads((tmp_path / "trace_rank0.json").read_text())
    names = [e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"]
    assert sorted(n for n in names if n.startswith("ProfilerStep#")) == ["ProfilerStep#1", "ProfilerStep#2"]
    assert sorted(n for n in names if n.startswith("work at")) == ["work at step 4", "work at step 5"]
    assert meter.trace_path == str(tmp_path / "trace_rank0.json")
    with pytest.raises(ValueError, match="--profile-steps must be 0 or more"):
        harness.Meter(7, torch.device("cpu"), 1, samples_per_step=1, profile=-1)


def test_without_the_flag_no_profiler_runs(tmp_path, monkeypatch):
    import torch

    from helpers.rank import harness

    monkeypatch.setenv("HELPERS_RUN_DIR", str(tmp_path))
    meter = harness.Meter(3, torch.device("cpu"), 1, samples_per_step=1, skip=1)
    for _ in meter.steps():
        meter.step(loss=0.0, samples=1)
    assert meter._prof is None and not list(tmp_path.glob("trace_rank*.json"))
