"""Notebook 02's lesson module: each claim it prints says True for the runs the notebook expects and False for runs
that break the claim (fake runs, nothing launched)."""
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers.notebook import checks
from helpers.notebook.lessons import ddp as lesson
from helpers.rank.models import SimpleCNN


def _verdicts(capsys) -> dict[str, bool]:
    return dict(checks.parse(capsys.readouterr().out))


def _step(rank, step, loss, step_s=0.1):
    return {"kind": "step", "rank": rank, "step": step, "loss": loss, "step_s": step_s}


class FakeRun(SimpleNamespace):
    def log(self, rank=0):
        return self.logs.get(rank, "")


def _train_run(losses_by_rank, *, port=12345, accuracy=0.5, global_batch=64):
    records = [_step(r, k + 1, loss) for r, losses in losses_by_rank.items() for k, loss in enumerate(losses)]
    records.append({"kind": "result", "rank": 0, "test_accuracy": accuracy, "global_batch": global_batch})
    return FakeRun(metrics=records, result={"test_accuracy": accuracy, "global_batch": global_batch}, port=port,
                   returncode=0, logs={})


def test_typed_command_keeps_the_rank_count_script_and_flags_and_drops_the_launchers_own():
    run = SimpleNamespace(nproc=2, command=["/x/python", "-c", "from torch.distributed.run import main; main()",
                                            "--rdzv-backend", "c10d", "--log-dir", "/x/runs/02/elastic", "--tee", "3",
                                            f"{lesson.PROJECT_ROOT}/course/ddp_cifar10.py", "--epochs", "1"])
    assert lesson.typed_command(run) == "torchrun --nproc-per-node 2 course/ddp_cifar10.py --epochs 1"


def test_training_claims_hold_for_a_good_run_and_fail_when_the_loss_rises_or_the_port_is_29500(capsys):
    good = _train_run({0: [2.0 - 0.1 * k for k in range(20)], 1: [2.05 - 0.1 * k for k in range(20)]})
    lesson.claim_training(good, nproc=2, batch_size=32)
    assert all(_verdicts(capsys).values())

    rising = _train_run({0: [1.0 + 0.1 * k for k in range(20)], 1: [1.05 + 0.1 * k for k in range(20)]}, port=29500)
    lesson.claim_training(rising, nproc=2, batch_size=32)
    verdicts = _verdicts(capsys)
    assert verdicts["loss decreased (mean of first vs last tenth of steps)"] is False
    assert verdicts["training ran on a port the launcher picked, not the blog's fixed 29500"] is False


def test_identical_losses_on_two_ranks_are_reported_as_not_differing(capsys):
    same = [2.0 - 0.1 * k for k in range(10)]
    lesson.claim_training(_train_run({0: same, 1: same}), nproc=2, batch_size=32)
    assert _verdicts(capsys)["the ranks' losses differ at every step (each rank's loss is on its own shard)"] is False


def test_a_rank_that_took_fewer_steps_fails_the_step_count_claim(capsys):
    lesson.claim_training(_train_run({0: [2.0, 1.9, 1.8, 1.0], 1: [2.1, 1.95, 1.7]}), nproc=2, batch_size=32)
    assert _verdicts(capsys)["every rank took the same number of steps"] is False


def test_self_relaunch_counts_generations_and_refuses_a_run_where_main_ran(capsys):
    lines = (["[generation 0] launching torchrun --nproc_per_node 2 on this same file"]
             + [f"[generation 1, RANK {r}] launching torchrun --nproc_per_node 2 on this same file" for r in (0, 1)]
             + [f"[generation 2, RANK {r}] safety cap reached: ..." for r in (0, 1, 0, 1)])
    lesson.show_self_relaunch(SimpleNamespace(output="\n".join(lines), timed_out=False))
    assert all(_verdicts(capsys).values())

    lesson.show_self_relaunch(SimpleNamespace(output="\n".join(lines[:2] + ["main() ran: training starts"]),
                                              timed_out=True))
    verdicts = _verdicts(capsys)
    assert not any(verdicts.values())


def test_mp_spawn_claim_reads_the_installed_default(capsys):
    lesson.claim_mp_spawn()
    assert all(_verdicts(capsys).values())


def _scaling_run(tmp_path: Path, n: int, step_s: float, *, cpus=2, threads=None, memory=800.0, samples=3200,
                 global_batch=64, steps=50):
    run_dir = tmp_path / f"scale_{n}"
    run_dir.mkdir()
    (run_dir / "env.json").write_text(json.dumps({"omp_num_threads": str(threads or max(1, cpus // n)),
                                                  "cpus": cpus}))
    records = [_step(r, k + 1, 1.0, step_s) for r in range(n) for k in range(steps)]
    result = {"global_batch": global_batch, "train_samples": samples, "peak_rss_mib": memory}
    return SimpleNamespace(run_dir=run_dir, metrics=records, result=result)


def test_scaling_claims_hold_on_cpu_for_similar_rates_and_memory(tmp_path, capsys):
    table = lesson.scaling_table({1: _scaling_run(tmp_path, 1, 0.1), 2: _scaling_run(tmp_path, 2, 0.12)})
    assert [len(row["rates"]) for row in table.values()] == [lesson.SCALE_WINDOWS] * 2
    assert table[1]["median_spread"][0] == pytest.approx(640.0)
    lesson.claim_scaling(table, nproc=2)
    assert all(_verdicts(capsys).values())


def test_scaling_claims_fail_for_a_collapse_other_samples_or_a_wrong_thread_count(tmp_path, capsys):
    table = lesson.scaling_table({1: _scaling_run(tmp_path, 1, 0.1),
                                  2: _scaling_run(tmp_path, 2, 1.0, threads=2, memory=2000.0, samples=6400)})
    lesson.claim_scaling(table, nproc=2)
    verdicts = _verdicts(capsys)
    assert verdicts["both configurations used the same global batch and samples"] is False
    assert verdicts["every rank got max(1, cores // ranks) OpenMP threads (the launcher's rule)"] is False
    assert not any(v for k, v in verdicts.items() if k.startswith("on CPU"))


def test_scaling_refuses_too_few_steps_for_its_windows(tmp_path):
    with pytest.raises(ValueError):
        lesson.scaling_table({1: _scaling_run(tmp_path, 1, 0.1, steps=lesson.SCALE_SKIP + 2)})


def test_simplecnn_gets_two_buckets_last_layers_first():
    layout = lesson.buckets(SimpleCNN())
    assert layout == [["fc2.bias", "fc2.weight", "fc1.bias", "fc1.weight"],
                      ["conv2.bias", "conv2.weight", "conv1.bias", "conv1.weight"]]
    # a bucket closes with the tensor that takes it past its cap: at 1 KiB, one layer (bias, weight) per bucket
    assert lesson.buckets(SimpleCNN(), bucket_cap_mb=1 / 1024) == [
        [f"{layer}.bias", f"{layer}.weight"] for layer in ("fc2", "fc1", "conv2", "conv1")]


def test_bucket_claims_are_true_for_the_installed_ddp(capsys):
    lesson.show_buckets(SimpleCNN())
    verdicts = _verdicts(capsys)
    assert len(verdicts) == 2 and all(verdicts.values())


def test_warmup_default_is_read_from_source_and_a_linear_default_is_reported():
    source = 'LOG = "log"\nclass WarmupLR:\n    def __init__(self, optimizer, warmup_type=LOG, last=-1):\n        pass\n'
    assert lesson.warmup_lr_default_type(source) == "log"
    assert lesson.warmup_lr_default_type(source.replace("warmup_type=LOG", "warmup_type='linear'")) == "linear"
    assert lesson.warmup_lr_default_type("class Other: pass\n") is None


def _unused_outcomes(tmp_path, *, message, printed):
    run_dir = tmp_path / "unused"
    run_dir.mkdir()
    for k in (0, 1):
        (run_dir / f"rank{k}.log").write_text("rank ready\n" + printed)
    error = SimpleNamespace(run_dir=run_dir, reason="failed")
    return {k: {"error": {"type": "RuntimeError", "message": message, "line": 9}} for k in (0, 1)}, error


DDP_MESSAGE = ("Expected to have finished reduction in the prior iteration before starting a new one. This error "
               "indicates that your module has parameters that were not used in producing loss. You can enable "
               "unused parameter detection by passing the keyword argument `find_unused_parameters=True` to "
               "`torch.nn.parallel.DistributedDataParallel`, and by ...")
BOTH_TRAINED = ("trained 2 steps with {'find_unused_parameters': True}\n"
                "trained 2 steps with {'static_graph': True}\n")


def test_unused_parameter_demo_claims_read_the_ranks_logs_and_ddps_error(tmp_path, capsys, monkeypatch):
    from helpers.notebook.exercises import ranks

    def train(model, dataset, epochs):
        return model

    monkeypatch.setattr(ranks, "run_on_ranks",
                        lambda *a, **k: _unused_outcomes(tmp_path, message=DDP_MESSAGE, printed=BOTH_TRAINED))
    lesson.unused_parameter_demo(train)
    out = capsys.readouterr().out
    assert "Expected to have finished reduction in the prior iteration before starting a new one." in out
    assert out.count(": True") == 2


def test_unused_parameter_demo_says_false_when_an_option_did_not_train_or_the_error_is_another(tmp_path, capsys,
                                                                                           monkeypatch):
    from helpers.notebook.exercises import ranks

    def train(model, dataset, epochs):
        return model

    monkeypatch.setattr(ranks, "run_on_ranks", lambda *a, **k: _unused_outcomes(
        tmp_path, message="shape mismatch", printed="trained 2 steps with {'find_unused_parameters': True}\n"))
    lesson.unused_parameter_demo(train)
    verdicts = _verdicts(capsys)
    assert len(verdicts) == 2 and not any(verdicts.values())


def test_reload_claims_compare_the_accuracy_and_the_keys(capsys):
    model = SimpleCNN()
    lesson.claim_reload(model, 0.5, {"test_accuracy": 0.5})
    assert all(_verdicts(capsys).values())
    lesson.claim_reload(model, 0.4, {"test_accuracy": 0.5})
    assert _verdicts(capsys)["the reloaded model reproduces the ranks' accuracy"] is False
