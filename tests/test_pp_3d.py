"""DP x PP x TP on a 3-D DeviceMesh (course/gpt_3d.py): the mesh rules refused before launch, and the 2 x 2 x 2 run on
8 gloo ranks against one process reading the same global batches (tolerance from fp64 twins, as notebook 09)."""
from __future__ import annotations

import pytest

from helpers import launch
from helpers.calc import parity
from helpers.launch import Machine
from helpers.launch.spec import _launch_defaults, _launch_rules

SCRIPT = launch.PROJECT_ROOT / "course" / "gpt_3d.py"
CPU = Machine(gpus=0, cpus=8)


@pytest.mark.parametrize("nproc, args, problem", [
    (8, ["--pp", "3"], "--pp 3 x --tp 2 = 6 ranks per replica do not tile the 8 ranks"),
    (8, ["--tp", "3"], "--tp 3 does not divide the 8 ranks"),
    (8, ["--n-head", "3"], "--n-head 3 heads do not split over --tp 2"),
    (8, ["--pp", "4", "--tp", "1", "--n-layer", "6"], "--n-layer 6 does not split into 4 equal pipeline stages"),
    (8, ["--microbatches", "3"], "--microbatches 3 does not divide --batch-size 8"),
    (8, ["--pp", "4", "--tp", "2", "--microbatches", "2"], "needs at least as many micro-batches as stages"),
    (8, [], None), (4, ["--pp", "2", "--tp", "1"], None), (1, ["--pp", "1", "--tp", "1"], None),
])
def test_bad_mesh_input_is_refused_before_launch_and_good_input_passes(nproc, args, problem):
    if problem is None:
        assert launch.LaunchSpec.check("torchrun", SCRIPT, nproc, args, machine=CPU).nproc == nproc
        return
    with pytest.raises(launch.LaunchError, match=problem) as e:
        launch.LaunchSpec.check("torchrun", SCRIPT, nproc, args, machine=CPU)
    assert " use " in str(e.value)


def test_the_3d_script_declares_its_rules_and_its_defaults_match_its_parser(monkeypatch):
    import course.gpt_3d as script

    assert _launch_rules(SCRIPT) == script.LAUNCH_RULES and _launch_defaults(SCRIPT) == script.LAUNCH_DEFAULTS
    monkeypatch.setattr("sys.argv", ["gpt_3d.py"])
    args = script.parse_args()
    assert {f: str(getattr(args, f[2:].replace("-", "_"))) for f in script.LAUNCH_DEFAULTS} == script.LAUNCH_DEFAULTS


def _curve(run) -> list[float]:
    return [s["loss"] for s in run.metrics if s.get("kind") == "step" and s["rank"] == 0]


@pytest.mark.slow
def test_2x2x2_on_8_ranks_matches_one_process_and_every_rank_knows_its_role(runs_root):
    common = ["--steps", "6", "--skip-steps", "1"]
    one = ["--pp", "1", "--tp", "1", "--batch-size", "16"]  # the global batch: 2 dp shards of 8
    runs = {(n, d): launch.torchrun(SCRIPT, nproc=n, args=common + (one if n == 1 else []) + ["--dtype", d],
                                    show="none", timeout=600, stall_timeout=180)
            for n in (1, 8) for d in ("fp32", "fp64")}
    curve = {k: _curve(r) for k, r in runs.items()}
    floor = parity.twin_floor((curve[1, "fp32"], curve[1, "fp64"]), (curve[8, "fp32"], curve[8, "fp64"]))
    assert parity.check(curve[8, "fp64"], curve[1, "fp64"], floor, bound=parity.fp64_bound(floor))["ok"]
    assert parity.check(curve[8, "fp32"], curve[1, "fp32"], floor)["ok"]
    roles = {r: (res["dp_rank"], res["pp_stages"][0], res["tp_rank"])
             for r, res in runs[8, "fp32"].results_by_rank().items()}
    assert sorted(roles.values()) == [(d, p, t) for d in range(2) for p in range(2) for t in range(2)]
    assert roles[0] == (0, 0, 0) and roles[1] == (0, 0, 1) and roles[2] == (0, 1, 0) and roles[4] == (1, 0, 0)
    log = "".join(runs[8, "fp32"].log(r) for r in range(8))
    assert all(f"rank {r}: data shard {d} of 2, tensor shard {t} of 2" in log for r, (d, p, t) in roles.items())
    # the configuration guide's per-rank prediction (helpers.calc.plan) against what every rank measured
    from helpers.notebook.lessons import pipeline as lesson

    want = lesson.predicted_3d(runs[8, "fp32"])
    for res in runs[8, "fp32"].results_by_rank().values():
        st = want[res["pp_stages"][0]]
        assert res["rank_state_bytes"] == {"params": st["params_bytes"], "grads": st["grads"],
                                           "optimizer": st["optimizer"]}
        assert abs(res["pp_saved_bytes"][str(st["stage"])] / st["activations"] - 1) <= 0.10
