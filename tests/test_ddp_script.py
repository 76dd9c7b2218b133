"""course/ddp_cifar10.py, launched for real: two gloo ranks on the CPU train, agree, evaluate and checkpoint."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import launch
from helpers.rank.metrics import read_metrics, results, steps
from helpers.rank.models import SimpleCNN

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "course" / "ddp_cifar10.py"
TIMEOUT_S = 300

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    """One real 2-rank run shared by the tests below: (completed process, run dir)."""
    run_dir = tmp_path_factory.mktemp("ddp_cifar10")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-port", str(launch.free_port()), str(SCRIPT), "--epochs", "1", "--train-size", "2000",
               "--test-size", "500", "--dataset", "synthetic", "--out-dir", str(run_dir)]
    env = {**os.environ, "HELPERS_RUN_DIR": str(run_dir), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    # Own session, so a timeout kills torchrun and both ranks, not torchrun alone.
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"ddp_cifar10.py did not finish in {TIMEOUT_S} s:\n{output[-3000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, output), run_dir


def test_two_rank_run_exits_cleanly(ddp_run):
    proc, _ = ddp_run
    assert proc.returncode == 0, proc.stdout[-3000:]


def test_rank_zero_alone_prints_the_dataset_announcement(ddp_run):
    proc, _ = ddp_run
    assert proc.stdout.count("Dataset: SYNTHETIC") == 1, proc.stdout[-3000:]


def test_checkpoint_is_the_plain_model_state_and_loads_into_simple_cnn(ddp_run):
    _, run_dir = ddp_run
    checkpoint = run_dir / "ddp_model.pt"
    assert checkpoint.exists() and not list(run_dir.glob("*.tmp"))
    SimpleCNN().load_state_dict(torch.load(checkpoint, map_location="cpu", weights_only=True))  # strict


def test_both_ranks_report_every_step(ddp_run):
    _, run_dir = ddp_run
    records = read_metrics(run_dir)
    per_rank = {rank: [r["step"] for r in steps(records, rank)] for rank in (0, 1)}
    expected = next(r["steps"] for r in records if r["kind"] == "total")
    assert per_rank[0] == per_rank[1] == list(range(1, expected + 1))


def test_loss_goes_down(ddp_run):
    _, run_dir = ddp_run
    losses = [r["loss"] for r in steps(read_metrics(run_dir), rank=0)]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5


def test_result_reports_learned_accuracy_and_the_run_shape(ddp_run):
    _, run_dir = ddp_run
    result = results(read_metrics(run_dir))
    assert result["test_accuracy"] >= 0.6
    assert result["world_size"] == 2 and result["global_batch"] == 2 * 32
    assert result["dataset"] == "synthetic" and result["train_samples"] == 2000
    assert Path(result["checkpoint"]) == run_dir / "ddp_model.pt"
