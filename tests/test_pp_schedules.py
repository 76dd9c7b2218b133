"""Feasibility: every schedule torch.distributed.pipelining offers, on 2 and 4 gloo ranks, under a stall timeout,
against one process (loss parity, tolerance from fp64 twins: helpers/calc/parity.py).

What this torch does is recorded in helpers.calc.pipeline.FEASIBILITY, which the notebook reads: a schedule
recorded as running must run and match; one recorded as hanging or failing must still hang or fail that way (the
day torch fixes it, this test fails and the record, and the chapter, must change).

The 14 runs of the matrix (and their one-process references) are real launches, recorded by `make record` with a hash
of gpt_pp.py and what it imports, the arguments and torch's version (tests/recorded.py): the fast tier judges the
recorded curves and fails "stale" when an input changed. 1F1B on 2 ranks launches for real in the slow tier.
"""
from __future__ import annotations

import json

import pytest

from helpers import launch
from helpers.calc import parity, pipeline
from recorded import source_digest, torch_version

SCRIPT = launch.PROJECT_ROOT / "course" / "gpt_pp.py"
COMMON = ["--steps", "3", "--skip-steps", "0", "--n-layer", "8", "--d-model", "32", "--seq-len", "32",
          "--batch-size", "8", "--train-windows", "64"]
STALL_S = 90  # no output and no metric for this long: a hung pipeline (a step takes well under a second here)


def _curve(run) -> list[float]:
    return [s["loss"] for s in run.metrics if s.get("kind") == "step" and s["rank"] == 0]


def _launch(p: int, args: list[str]) -> dict:
    """One real run: rank 0's loss per step, or the launcher's error."""
    try:
        return {"curve": _curve(launch.torchrun(SCRIPT, nproc=p, args=args, show="none", timeout=300,
                                                stall_timeout=STALL_S)), "error": None}
    except launch.LaunchError as e:
        return {"curve": None, "error": str(e)}


@pytest.fixture
def run(request, recorder, runs_root):
    """``run(p, args)``: a launch of gpt_pp.py on ``p`` ranks, real in a test marked slow, otherwise replayed from
    the store (recorded under the run's own inputs, so the references are shared between tests)."""
    def get(p: int, args: list[str]) -> dict:
        if request.node.get_closest_marker("slow") is not None:
            return _launch(p, args)
        inputs = {"script": source_digest(SCRIPT), "nproc": str(p), "args": json.dumps(args), "torch": torch_version()}
        return recorder.get(f"gpt_pp.py on {p} rank(s)", " ".join(args), inputs, lambda: _launch(p, args))
    return get


def _matrix():
    cells = [(schedule, p) for p in (2, 4) for schedule in sorted(pipeline.SCHEDULES)]
    return [pytest.param(*c, marks=pytest.mark.slow) if c == ("1f1b", 2) else c for c in cells]


@pytest.mark.parametrize("schedule, p", _matrix())
def test_schedule_runs_on_gloo_and_matches_one_process_or_fails_as_recorded(run, schedule, p):
    m = pipeline.feasible_microbatches(schedule, p)
    recorded = pipeline.FEASIBILITY[schedule]
    args = COMMON + ["--schedule", schedule, "--microbatches", str(m)]
    outcomes = {d: run(p, args + ["--dtype", d]) for d in ("fp32", "fp64")}
    failed = next((o["error"] for o in outcomes.values() if o["error"] is not None), None)
    if failed is not None:
        assert recorded["status"] != "runs", f"{schedule} on {p} ranks is recorded as running, but: {failed}"
        assert recorded["error"] in failed, f"{schedule} on {p} ranks fails otherwise than recorded: {failed}"
        return
    assert recorded["status"] == "runs", f"{schedule} now runs on {p} gloo ranks: update pipeline.FEASIBILITY"
    runs = {d: o["curve"] for d, o in outcomes.items()}
    ref = {d: run(1, COMMON + ["--microbatches", str(m), "--dtype", d])["curve"] for d in ("fp32", "fp64")}
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


def _probe(tmp_path, argv: list[str]) -> dict:
    import subprocess
    import sys

    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(probe), *argv],
                          capture_output=True, text=True, timeout=120)
    return {"returncode": done.returncode, "output": done.stdout + done.stderr}


@pytest.mark.parametrize("schedule", sorted(s for s, r in pipeline.FEASIBILITY.items() if r.get("min_microbatches")))
def test_too_few_microbatches_are_refused_by_torch_itself_as_recorded(tmp_path, recorder, request, schedule):
    """The precondition the launch rule enforces is torch's own: a bare schedule (one Linear per stage, no course
    code) built with one micro-batch fewer than the rule asks is refused by torch with the recorded error. The
    probes are real 2-rank runs, recorded by `make record` (stale when the probe or torch changes)."""
    p = 2
    cls, per_rank, place = pipeline.SCHEDULES[schedule]
    m = pipeline.min_microbatches(schedule, p) - 1
    assert pipeline.microbatches_split_batch("--microbatches", str(m), p, {"--schedule": schedule, "--batch-size": "8"})

    def probe(count: int) -> dict:
        argv = [cls, str(count), str(per_rank), place]
        return recorder.get(request.node.nodeid, " ".join(argv), {"probe": PROBE, "argv": json.dumps(argv),
                                                                 "torch": torch_version()},
                            lambda: _probe(tmp_path, argv))
    bad = probe(m)
    refusal = pipeline.FEASIBILITY[schedule]["min_microbatches"]["error"]
    assert bad["returncode"] != 0 and refusal in bad["output"]
    good = probe(m + 1)
    assert good["returncode"] == 0 and "stepped" in good["output"]  # the fault is the count, not the probe
