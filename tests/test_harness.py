"""The rank-side harness (helpers/rank/harness.py), the one throughput definition (helpers/calc/throughput.py) and the
result schema the Reporter enforces: pure parts here directly, the rest through real 2-rank runs of course scripts."""
import math
from pathlib import Path

import pytest

from helpers import launch
from helpers.calc import throughput
from helpers.rank import metrics

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------- the throughput rule


def test_throughput_takes_the_slowest_rank_of_each_step_and_the_median_after_the_warmup():
    rank0 = [5.0, 0.10, 0.10, 0.40, 0.10]
    rank1 = [4.0, 0.20, 0.10, 0.10, 0.10]  # step 2's slowest rank is rank 1, step 4's rank 0
    assert throughput.slowest_rank_step_s({0: rank0, 1: rank1}) == [5.0, 0.20, 0.10, 0.40, 0.10]
    # steps 2..5 after skipping 1: [0.2, 0.1, 0.4, 0.1] -> median 0.15
    assert throughput.steady_samples_per_s([rank0, rank1], samples_per_step=60, skip=1) == pytest.approx(400.0)


def test_one_slow_step_does_not_move_the_median_but_the_warmup_is_left_out():
    steady = [0.1] * 9
    assert throughput.steady_samples_per_s([[9.0] + steady], 10, skip=1) == pytest.approx(100.0)
    assert throughput.steady_samples_per_s([steady[:4] + [9.0] + steady[4:]], 10, skip=0) == pytest.approx(100.0)
    assert throughput.steady_samples_per_s([[9.0] * 3 + steady], 10, skip=0) == pytest.approx(100.0)


def test_throughput_is_none_when_no_step_is_left_and_refuses_unpaired_ranks():
    assert throughput.steady_samples_per_s([[0.1, 0.1]], 10, skip=2) is None
    with pytest.raises(ValueError, match="same steps"):
        throughput.steady_samples_per_s([[0.1, 0.1], [0.1]], 10, skip=0)
    with pytest.raises(ValueError, match="skip"):
        throughput.steady_step_s([[0.1]], skip=-1)


def test_median_spread_reports_median_min_and_max():
    assert throughput.median_spread([3.0, 1.0, 2.0, 10.0]) == (2.5, 1.0, 10.0)


# ------------------------------------------------------------------------------------------- the schema


def test_reporter_refuses_a_misspelled_field_and_names_the_one_meant(tmp_path):
    rep = metrics.Reporter(run_dir=tmp_path, rank=0)
    with pytest.raises(metrics.SchemaError, match="'test_acuracy'.*did you mean 'test_accuracy'"):
        rep.result(test_acuracy=0.5)
    with pytest.raises(metrics.SchemaError, match="'los'.*did you mean 'loss'"):
        rep.step(1, los=0.5)
    assert metrics.read_metrics(tmp_path) == []  # nothing half-written


def test_reporter_refuses_a_value_of_the_wrong_type_and_accepts_none(tmp_path):
    rep = metrics.Reporter(run_dir=tmp_path, rank=0)
    with pytest.raises(metrics.SchemaError, match="world_size.*int"):
        rep.result(world_size="2")
    with pytest.raises(metrics.SchemaError, match="world_size.*int"):
        rep.result(world_size=True)  # a bool is not a count
    with pytest.raises(metrics.SchemaError, match="loss.*float"):
        rep.step(1, loss="0.5")
    rep.result(world_size=2, samples_per_s=None, test_accuracy=1)  # an int is a float; None is "not measured"
    rep.step(1, loss=0.5, step_s=0.1)
    assert [r["kind"] for r in metrics.read_metrics(tmp_path)] == ["result", "step"]


def test_reporter_checks_without_a_run_directory_and_demos_opt_out(tmp_path):
    with pytest.raises(metrics.SchemaError):
        metrics.Reporter(run_dir=None).result(not_a_field=1)  # a terminal run finds the typo too
    free = metrics.Reporter(run_dir=tmp_path, rank=0, schema=None)
    free.result(env_rank=0, anything="goes")
    assert metrics.results(metrics.read_metrics(tmp_path))["anything"] == "goes"


def test_training_scripts_use_the_checked_schema():
    """The scripts built on the harness never opt out of the schema (demos and probes may, and say so)."""
    training = [p for p in (REPO / "course").glob("*.py") if "helpers.rank import harness" in p.read_text()]
    assert {p.name for p in training} >= {"ddp_cifar10.py", "ds_cifar10.py", "fsdp2_cifar10.py", "ddp_tuning.py",
                                          "ds_tuning.py", "elastic_cifar10.py"}
    assert not [p.name for p in training if "schema=None" in p.read_text()]


def test_dtype_flag_offers_fp32_and_the_fp64_that_measures_its_rounding():
    """--dtype of the plain PyTorch scripts (DDP, FSDP2): fp32 by default, fp64 for the noise floor, nothing else."""
    import torch
    from helpers.rank import harness
    p = harness.dtype_flag(harness.parser("test"))
    assert harness.train_dtype(p.parse_args([])) is torch.float32
    assert harness.train_dtype(p.parse_args(["--dtype", "fp64"])) is torch.float64
    with pytest.raises(SystemExit):
        p.parse_args(["--dtype", "bf16"])  # bf16 is --bf16 (autocast / MixedPrecisionPolicy), not a weight dtype


# ------------------------------------------------------------------------------------------- real runs


@pytest.fixture(scope="module")
def ddp_run(module_runs_root):
    return launch.torchrun("course/ddp_cifar10.py", nproc=2, show="none", timeout=300, stall_timeout=120,
                           args=["--dataset", "synthetic", "--train-size", 640, "--test-size", 64,
                                 "--batch-size", 16, "--skip-steps", 3])


@pytest.mark.slow
def test_steps_are_numbered_from_one_and_the_result_uses_the_one_throughput_rule(ddp_run):
    records = ddp_run.metrics
    total = next(r for r in records if r["kind"] == "total" and r["rank"] == 0)
    assert total == {**total, "steps": 20, "start": 0}  # 640 images / 2 ranks / 16 per batch
    by_rank = {k: [r["step"] for r in metrics.steps(records, k)] for k in (0, 1)}
    assert by_rank[0] == by_rank[1] == list(range(1, 21))
    step_s = {k: [r["step_s"] for r in metrics.steps(records, k)] for k in (0, 1)}
    expected = throughput.steady_samples_per_s(step_s, samples_per_step=32, skip=3)
    assert ddp_run.result["samples_per_s"] == pytest.approx(expected, rel=1e-12)
    assert ddp_run.result["timed_steps"] == 17 and ddp_run.result["train_samples"] == 640
    assert math.isfinite(ddp_run.result["first_step_s"])


@pytest.mark.slow
def test_the_progress_bar_ends_on_the_last_step(runs_root, monkeypatch, capsys):
    monkeypatch.setenv("HELPERS_OUTPUT", "live")
    launch.torchrun("course/ddp_cifar10.py", nproc=2, show="rank0", timeout=300, stall_timeout=120,
                    args=["--dataset", "synthetic", "--train-size", 320, "--test-size", 32, "--batch-size", 16])
    err = capsys.readouterr().err
    assert "10/10" in err and "11/10" not in err, err[-2000:]


def test_window_rates_split_the_steady_steps_into_equal_windows():
    step_s = [[9.0, 0.1, 0.1, 0.2, 0.2, 0.5], [1.0, 0.1, 0.12, 0.1, 0.25, 0.1]]
    # slowest rank per step: 9.0 | 0.1 0.12 | 0.2 0.25 | 0.5 (left over, not a whole window)
    rates = throughput.window_samples_per_s(step_s, samples_per_step=10, skip=1, windows=2)
    assert rates == pytest.approx([10 / 0.11, 10 / 0.225])


def test_window_rates_refuse_more_windows_than_steady_steps():
    with pytest.raises(ValueError, match="cannot fill 3 windows"):
        throughput.window_samples_per_s([[1.0, 0.1, 0.1]], samples_per_step=10, skip=1, windows=3)
    with pytest.raises(ValueError, match="windows must be"):
        throughput.window_samples_per_s([[1.0, 0.1, 0.1]], samples_per_step=10, skip=1, windows=0)
