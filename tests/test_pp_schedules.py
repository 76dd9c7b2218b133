"""Feasibility: every schedule torch.distributed.pipelining offers, on 2 and 4 gloo ranks, under a stall timeout,
against one process (loss parity, tolerance from fp64 twins: helpers/calc/parity.py).

What this torch does is recorded in helpers.calc.pipeline.FEASIBILITY, which the notebook reads: a schedule
recorded as running must run and match; one recorded as hanging or failing must still hang or fail that way (the
day torch fixes it, this test fails and the record, and the chapter, must change).
"""
from __future__ import annotations

import pytest

from helpers import launch
from helpers.calc import parity, pipeline

SCRIPT = launch.PROJECT_ROOT / "course" / "gpt_pp.py"
COMMON = ["--steps", "3", "--skip-steps", "0", "--n-layer", "8", "--d-model", "32", "--seq-len", "32",
          "--batch-size", "8", "--train-windows", "64"]
STALL_S = 90  # no output and no metric for this long: a hung pipeline (a step takes well under a second here)


def _curve(run) -> list[float]:
    return [s["loss"] for s in run.metrics if s.get("kind") == "step" and s["rank"] == 0]


@pytest.fixture(scope="module")
def reference(module_runs_root):
    """The one-process run (the whole GPT, no pipeline), in fp32 and fp64, per micro-batch count."""
    cache: dict = {}

    def get(m: int) -> dict:
        if m not in cache:
            cache[m] = {d: _curve(launch.torchrun(SCRIPT, nproc=1, show="none", timeout=300,
                                                  args=COMMON + ["--microbatches", str(m), "--dtype", d]))
                        for d in ("fp32", "fp64")}
        return cache[m]
    return get


@pytest.mark.slow
@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("schedule", sorted(pipeline.SCHEDULES))
def test_schedule_runs_on_gloo_and_matches_one_process_or_fails_as_recorded(reference, schedule, p):
    m = pipeline.feasible_microbatches(schedule, p)
    recorded = pipeline.FEASIBILITY[schedule]
    args = COMMON + ["--schedule", schedule, "--microbatches", str(m)]
    try:
        runs = {d: _curve(launch.torchrun(SCRIPT, nproc=p, args=args + ["--dtype", d], show="none", timeout=300,
                                          stall_timeout=STALL_S)) for d in ("fp32", "fp64")}
    except launch.LaunchError as e:
        assert recorded["status"] != "runs", f"{schedule} on {p} ranks is recorded as running, but: {e}"
        assert recorded["error"] in str(e), f"{schedule} on {p} ranks fails otherwise than recorded: {e}"
        return
    assert recorded["status"] == "runs", f"{schedule} now runs on {p} gloo ranks: update pipeline.FEASIBILITY"
    ref = reference(m)
    floor = parity.twin_floor((ref["fp32"], ref["fp64"]), (runs["fp32"], runs["fp64"]))
    assert parity.check(runs["fp32"], ref["fp32"], floor)["ok"], parity.describe(
        parity.check(runs["fp32"], ref["fp32"], floor))
    assert parity.check(runs["fp64"], ref["fp64"], floor, bound=parity.fp64_bound(floor))["ok"]


PROBE = """
import sys, torch, torch.distributed as dist, torch.distributed.pipelining as pp
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
per_rank = int(sys.argv[3])
mine = [rank, 2 * world - 1 - rank] if sys.argv[4] == "v" else [rank + k * world for k in range(per_rank)]
stages = [pp.PipelineStage(torch.nn.Linear(4, 4), s, world * per_rank, torch.device("cpu")) for s in mine]
cls = getattr(pp, sys.argv[1])
schedule = cls(stages if per_rank > 1 else stages[0], n_microbatches=int(sys.argv[2]),
               loss_fn=lambda out, y: ((out - y) ** 2).mean())
x = torch.randn(8, 4)
schedule.step(*((x,) if 0 in mine else ()), target=x if world * per_rank - 1 in mine else None,
              losses=[] if world * per_rank - 1 in mine else None)
print("stepped", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.parametrize("schedule", sorted(s for s, r in pipeline.FEASIBILITY.items() if r.get("min_microbatches")))
def test_too_few_microbatches_are_refused_by_torch_itself_as_recorded(tmp_path, schedule):
    """The precondition the launch rule enforces is torch's own: a bare schedule (one Linear per stage, no course
    code) built with one micro-batch fewer than the rule asks is refused by torch with the recorded error."""
    import subprocess
    import sys

    p = 2
    cls, per_rank, place = pipeline.SCHEDULES[schedule]
    m = pipeline.min_microbatches(schedule, p) - 1
    assert pipeline.microbatches_split_batch("--microbatches", str(m), p, {"--schedule": schedule, "--batch-size": "8"})
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    run = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(p), str(probe)]
    bad = subprocess.run(run + [cls, str(m), str(per_rank), place], capture_output=True, text=True, timeout=120)
    refusal = pipeline.FEASIBILITY[schedule]["min_microbatches"]["error"]
    assert bad.returncode != 0 and refusal in bad.stdout + bad.stderr
    good = subprocess.run(run + [cls, str(m + 1), str(per_rank), place], capture_output=True, text=True, timeout=120)
    assert good.returncode == 0 and "stepped" in good.stdout  # the fault is the count, not the probe
