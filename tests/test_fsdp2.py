"""course/fsdp2_cifar10.py, launched for real on CPU ranks (gloo): 1, 2 and 3 ranks, the same losses as DDP and one
process, a DCP checkpoint saved on 2 ranks and resumed on 3, its plain-file export, model states against the ZeRO-3
formula, and the communication FSDP2 does per step against the 3P of the ZeRO paper.

Tolerance, derived in the same run (helpers/calc/parity.py): float addition is not associative, so the ranks, summing
the same global batches in another order (per rank, then reduced), drift from one process in fp32, a drift Adam
carries into every later step; in exact arithmetic they are the same computation. The one-process run is also made in
fp64, and so is the 2-rank run: the larger distance of an fp32 run from its fp64 twin is the floor of fp32 rounding
here, and every fp32 run must lie within parity.K x floor of the one-process fp32 run. The 2-rank fp64 run must agree
with the one-process fp64 run within parity.fp64_bound(floor) (the same drift from 2**-29 smaller roundings)."""
import os
import statistics
from pathlib import Path

import pytest
import torch

from helpers import launch
from helpers.calc import comm, memory, parity
from helpers.rank.metrics import steps
from helpers.rank.models import SimpleCNN

pytestmark = pytest.mark.slow

SCRIPT = "course/fsdp2_cifar10.py"
ROOT = launch.PROJECT_ROOT
GLOBAL_BATCH = 48
STEPS = 16  # one epoch of TRAIN_SIZE at GLOBAL_BATCH
DATA = ["--dataset", "synthetic", "--train-size", str(STEPS * GLOBAL_BATCH), "--test-size", "96", "--skip-steps", "2"]
TIMEOUT_S = 300
ENV = {"CUDA_VISIBLE_DEVICES": ""}


def _torchrun(script, nproc, args, name):
    return launch.torchrun(script, nproc=nproc, args=args, env=ENV, timeout=TIMEOUT_S, stall_timeout=120,
                           show="none", name=name)


@pytest.fixture(scope="module")
def runs(module_runs_root):
    """FSDP2 on 1 rank (all steps, in fp32 and in fp64), on 2 ranks (first half, saved and exported; and in fp64),
    resumed on 3 ranks (second half), and DDP on 2 ranks, all on the same global batches."""
    ckpt, plain = module_runs_root / "dcp", module_runs_root / "plain.pt"
    out = {"one": _torchrun(SCRIPT, 1, DATA + ["--batch-size", GLOBAL_BATCH], "fsdp2_one")}
    out["one64"] = _torchrun(SCRIPT, 1, DATA + ["--batch-size", GLOBAL_BATCH, "--dtype", "fp64"], "fsdp2_one_fp64")
    out["two64"] = _torchrun(SCRIPT, 2, DATA + ["--batch-size", GLOBAL_BATCH // 2, "--steps", STEPS // 2,
                                                "--dtype", "fp64"], "fsdp2_two_fp64")
    out["two"] = _torchrun(SCRIPT, 2, DATA + ["--batch-size", GLOBAL_BATCH // 2, "--steps", STEPS // 2,
                                              "--save-dir", ckpt, "--export", plain], "fsdp2_two")
    out["three"] = _torchrun(SCRIPT, 3, DATA + ["--batch-size", GLOBAL_BATCH // 3, "--load-dir", ckpt], "fsdp2_three")
    out["ddp"] = _torchrun("course/ddp_cifar10.py", 2, DATA + ["--batch-size", GLOBAL_BATCH // 2], "ddp_two")
    out["plain"] = plain
    return out


def mean_loss(run) -> dict[int, float]:
    """The loss of the global batch at each step: the mean of the ranks' losses (equal per-rank batches)."""
    by_step: dict[int, list[float]] = {}
    for r in steps(run.metrics):
        by_step.setdefault(r["step"], []).append(r["loss"])
    assert all(len(v) == run.result["world_size"] for v in by_step.values())
    return {s: statistics.fmean(v) for s, v in sorted(by_step.items())}


def test_script_runs_at_one_two_and_three_ranks(runs):
    for key, n in (("one", 1), ("two", 2), ("three", 3)):
        assert runs[key].returncode == 0 and runs[key].result["world_size"] == n
        assert runs[key].result["framework"] == "fsdp2" and runs[key].result["global_batch"] == GLOBAL_BATCH


def _floor(runs, upto):
    """fp32 rounding's floor over steps 1..upto: the larger distance of the one-process and the 2-rank fp32 run from
    its fp64 twin (parity.twin_floor: one pair alone is a noisy measure)."""
    assert runs["one64"].result["dtype"] == "fp64" and runs["one"].result["dtype"] == "fp32"
    one, one64 = mean_loss(runs["one"]), mean_loss(runs["one64"])
    upto_one = {s: v for s, v in one.items() if s <= upto}
    pairs = [(upto_one, {s: one64[s] for s in upto_one})]
    two, two64 = mean_loss(runs["two"]), mean_loss(runs["two64"])
    pairs.append(({s: two[s] for s in two if s <= upto}, {s: two64[s] for s in two if s <= upto}))
    return parity.twin_floor(*pairs)


def test_first_losses_equal_ddp_and_one_process_in_fp32(runs):
    one, two, ddp = mean_loss(runs["one"]), mean_loss(runs["two"]), mean_loss(runs["ddp"])
    assert sorted(two) == list(range(1, STEPS // 2 + 1)) and sorted(ddp) == list(range(1, STEPS + 1))
    for label, curve in (("FSDP2 on 2 ranks", two), ("DDP on 2 ranks", ddp)):
        result = parity.check(curve, one, _floor(runs, max(curve)))  # the floor of the steps compared
        print(f"{label} vs one process, steps 1-{max(curve)}: {parity.describe(result)}")
        assert result["ok"], f"{label} vs one process: {parity.describe(result)}"


def test_resume_on_three_ranks_continues_the_loss_curve(runs):
    three, one = mean_loss(runs["three"]), mean_loss(runs["one"])
    assert runs["three"].result["resumed_from"] == STEPS // 2 and runs["three"].result["steps"] == STEPS
    assert sorted(three) == list(range(STEPS // 2 + 1, STEPS + 1))
    result = parity.check(three, one, _floor(runs, STEPS))
    print(f"resumed on 3 ranks vs one process, steps {STEPS // 2 + 1}-{STEPS}: {parity.describe(result)}")
    assert result["ok"], f"resumed on 3 ranks vs one process: {parity.describe(result)}"


def test_fp64_ranks_agree_with_one_fp64_process_far_below_the_fp32_floor(runs):
    """In fp64 the same reordering leaves 2**-29 of fp32's drift: the bound follows from the fp32 floor."""
    two64, one64 = mean_loss(runs["two64"]), mean_loss(runs["one64"])
    assert runs["two64"].result["dtype"] == "fp64" and sorted(two64) == list(range(1, STEPS // 2 + 1))
    floor = _floor(runs, STEPS // 2)
    result = parity.check(two64, one64, floor, bound=parity.fp64_bound(floor))
    print(f"FSDP2 fp64 on 2 ranks vs one fp64 process: {parity.describe(result)}")
    assert result["ok"], f"FSDP2 fp64 on 2 ranks vs one fp64 process: {parity.describe(result)}"


def test_exported_checkpoint_loads_into_a_plain_model(runs):
    state = torch.load(runs["plain"], map_location="cpu", weights_only=False)
    model = SimpleCNN()
    model.load_state_dict(state["model"])  # strict: every key, every shape, no FSDP or DTensor left
    assert all(type(t) is torch.Tensor for t in state["model"].values())
    assert int(state["step"]) == STEPS // 2


@pytest.mark.parametrize("key", ["two", "three"])
def test_model_states_per_rank_within_5_percent_of_the_zero3_formula(runs, key):
    run = runs[key]
    params, n = run.result["params"], run.result["world_size"]
    formula = memory.zero_model_state_bytes(params, n, stage=3, precision="fp32")["total"]  # (4 + 4 + 8) P / N
    by_rank = run.results_by_rank()
    assert sorted(by_rank) == list(range(n))
    for rank, r in by_rank.items():
        ratio = r["model_state_bytes"]["total"] / formula
        assert 0.95 <= ratio <= 1.05, (rank, ratio)


@pytest.mark.parametrize("key", ["two", "three"])
def test_communication_per_step_is_3p_like_zero3(runs, key):
    """All-gather in forward and again in backward, reduce-scatter in backward: 3 x 4P (N-1)/N bytes sent per rank."""
    run = runs[key]
    params, n = run.result["params"], run.result["world_size"]
    per_step = run.results_by_rank()[0]["comm_per_step"]
    assert per_step["all_gather_into_tensor"]["calls"] == 2 * 4  # 4 sharding units, forward and backward
    assert per_step["reduce_scatter_tensor"]["calls"] == 4
    sent = sum(comm.bytes_sent_per_rank(op, v["bytes"], n) for op, v in per_step.items())
    theory = 3 * 4 * params * (n - 1) / n
    assert 0.95 <= sent / theory <= 1.05, sent / theory


def test_no_reshard_after_forward_gathers_once_per_step(module_runs_root):
    run = _torchrun(SCRIPT, 2, DATA + ["--batch-size", GLOBAL_BATCH // 2, "--steps", 3, "--no-reshard-after-forward"],
                    "fsdp2_keep")
    per_step = run.results_by_rank()[0]["comm_per_step"]
    assert run.result["reshard_after_forward"] is False
    assert per_step["all_gather_into_tensor"]["calls"] == 4 and per_step["reduce_scatter_tensor"]["calls"] == 4


def test_cpu_offload_on_a_cpu_rank_is_refused_with_what_to_change(module_runs_root):
    with pytest.raises(launch.LaunchError) as err:
        _torchrun(SCRIPT, 2, DATA + ["--steps", 1, "--cpu-offload"], "fsdp2_offload_cpu")
    logs = Path(err.value.run_dir).glob("rank*.log") if err.value.run_dir else []
    text = str(err.value) + "".join(log.read_text() for log in logs)
    assert "drop --cpu-offload" in text


def test_hsdp_with_shard_size_one_trains_like_ddp_and_holds_ddp_memory(runs):
    run = _torchrun(SCRIPT, 2, DATA + ["--batch-size", GLOBAL_BATCH // 2, "--steps", 4, "--shard-size", 1], "fsdp2_hsdp")
    assert run.result["shard_size"] == 1 and run.results_by_rank()[0]["comm_per_step"] is None
    hsdp, one = mean_loss(run), mean_loss(runs["one"])
    result = parity.check(hsdp, one, _floor(runs, max(hsdp)))  # DDP-like, so one process's curve within K floors
    assert result["ok"], f"HSDP (shard size 1) vs one process: {parity.describe(result)}"
    whole = memory.zero_model_state_bytes(run.result["params"], 2, stage=0, precision="fp32")["total"]  # 16 P
    for r in run.results_by_rank().values():
        assert 0.95 <= r["model_state_bytes"]["total"] / whole <= 1.05


@pytest.mark.parametrize("bad", [["--shard-size", 4], ["--shard-size=3"], ["--shard-size", "two"]])
def test_a_bad_mesh_is_refused_before_launch_with_what_to_use(module_runs_root, bad):
    with pytest.raises(launch.LaunchError) as err:
        _torchrun(SCRIPT, 2, DATA + ["--steps", 1, *bad], "fsdp2_bad_mesh")
    assert err.value.reason == "invalid" and err.value.run_dir is None  # nothing started, no run folder
    assert "use one of 1, 2" in str(err.value) or "whole number of ranks" in str(err.value)
    assert not (module_runs_root / "fsdp2_bad_mesh").exists()


def test_a_bad_mesh_given_to_the_script_directly_stops_each_rank_with_the_same_message(tmp_path):
    # from a terminal, without helpers.launch in between: the script applies the same rule inside each rank
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                          str(ROOT / SCRIPT), *map(str, DATA), "--steps", "1", "--shard-size", "2"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120, env={**os.environ, **ENV})
    assert out.returncode != 0 and "use one of 1" in out.stdout + out.stderr
