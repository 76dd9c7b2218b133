"""course/fsdp2_cifar10.py beyond what notebook 07 claims under nbval (1, 2 and 3 ranks against DDP and one process,
the DCP checkpoint resharded from 2 ranks to 3 and exported, model states against the ZeRO-3 formula, 3P of
communication): HSDP, launched for real, and the script's refusals, called in this process.

Tolerance, derived in the same run (helpers/calc/parity.py): float addition is not associative, so the ranks, summing
the same global batches in another order (per rank, then reduced), drift from one process in fp32, a drift Adam
carries into every later step; in exact arithmetic they are the same computation. The one-process run is also made in
fp64, and so is the 2-rank run: the larger distance of an fp32 run from its fp64 twin is the floor of fp32 rounding
here, and every fp32 run must lie within parity.K x floor of the one-process fp32 run. The 2-rank fp64 run must agree
with the one-process fp64 run within parity.fp64_bound(floor) (the same drift from 2**-29 smaller roundings)."""
import statistics

import pytest

from helpers import launch
from helpers.calc import memory, parity
from helpers.rank.metrics import steps

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


def mean_loss(run) -> dict[int, float]:
    """The loss of the global batch at each step: the mean of the ranks' losses (equal per-rank batches)."""
    by_step: dict[int, list[float]] = {}
    for r in steps(run.metrics):
        by_step.setdefault(r["step"], []).append(r["loss"])
    assert all(len(v) == run.result["world_size"] for v in by_step.values())
    return {s: statistics.fmean(v) for s, v in sorted(by_step.items())}


@pytest.mark.slow
def test_hsdp_with_shard_size_one_trains_like_ddp_and_holds_ddp_memory(module_runs_root):
    """No notebook runs HSDP. Shard size 1 is DDP's layout: one process's loss curve within the fp32 floor (measured
    from fp64 twins of both runs), every rank holding the whole 16 P of model states, and no FSDP collectives."""
    steps4 = ["--steps", 4]
    one = {d: _torchrun(SCRIPT, 1, DATA + ["--batch-size", GLOBAL_BATCH, *steps4, "--dtype", d], f"one_{d}")
           for d in ("fp32", "fp64")}
    hsdp = {d: _torchrun(SCRIPT, 2, DATA + ["--batch-size", GLOBAL_BATCH // 2, *steps4, "--shard-size", 1,
                                            "--dtype", d], f"hsdp_{d}") for d in ("fp32", "fp64")}
    run = hsdp["fp32"]
    assert run.result["shard_size"] == 1 and run.results_by_rank()[0]["comm_per_step"] is None
    floor = parity.twin_floor(*[(mean_loss(pair["fp32"]), mean_loss(pair["fp64"])) for pair in (one, hsdp)])
    result = parity.check(mean_loss(run), mean_loss(one["fp32"]), floor)
    assert result["ok"], f"HSDP (shard size 1) vs one process: {parity.describe(result)}"
    whole = memory.zero_model_state_bytes(run.result["params"], 2, stage=0, precision="fp32")["total"]  # 16 P
    for r in run.results_by_rank().values():
        assert 0.95 <= r["model_state_bytes"]["total"] / whole <= 1.05


def test_cpu_offload_on_a_cpu_rank_is_refused_with_what_to_change(refused_in_rank):
    assert "drop --cpu-offload" in refused_in_rank(SCRIPT, DATA + ["--steps", 1, "--cpu-offload"])


@pytest.mark.parametrize("bad", [["--shard-size", 4], ["--shard-size=3"], ["--shard-size", "two"]])
def test_a_bad_mesh_is_refused_before_launch_with_what_to_use(runs_root, bad):
    with pytest.raises(launch.LaunchError) as err:
        launch.LaunchSpec.check("torchrun", ROOT / SCRIPT, 2, [*map(str, DATA), "--steps", "1", *map(str, bad)],
                                env=ENV, machine=launch.Machine(gpus=0, cpus=2))
    assert err.value.reason == "invalid" and err.value.run_dir is None  # nothing started, no run folder
    assert "use one of 1, 2" in str(err.value) or "whole number of ranks" in str(err.value)
    assert not runs_root.exists()


def test_a_bad_mesh_given_to_the_script_directly_stops_each_rank_with_the_same_message(refused_in_rank):
    # from a terminal, without helpers.launch in between: the script applies the same rule inside each rank
    assert "use one of 1" in refused_in_rank(SCRIPT, DATA + ["--steps", 1, "--shard-size", 2], world_size=1)
