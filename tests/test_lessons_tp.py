"""helpers.notebook.lessons.tp: notebook 09's settings refuse what cannot run, and its claims say False when the
measurements contradict the prose (fake runs, built from the formula and then broken)."""
from __future__ import annotations

import pytest

from helpers.calc import tp
from helpers.notebook import checks
from helpers.notebook.lessons import tp as lesson

NAMES = {"all_reduce": "all_reduce", "all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor"}
FULL = {"tok_emb.weight": [29, 96], "blocks.0.ln1.weight": [96], "blocks.0.attn.q.weight": [96, 96],
        "blocks.0.attn.proj.weight": [96, 96], "blocks.0.mlp.up.weight": [384, 96], "head.weight": [29, 96]}


def verdicts(capsys) -> dict[str, bool]:
    return dict(checks.parse(capsys.readouterr().out))


class FakeRun:
    def __init__(self, by_rank: dict, losses=(), returncode=0, log="debug=DETAIL"):
        self._by_rank, self.returncode, self.run_dir, self._log = by_rank, returncode, "fake", log
        self.result = by_rank.get(0, {})
        self.metrics = [{"kind": "step", "rank": r, "step": i + 1, "loss": v}
                        for r in by_rank for i, v in enumerate(losses)]

    def results_by_rank(self):
        return self._by_rank

    def log(self, rank: int) -> str:
        return self._log


def tp_run(nproc: int, sp: bool, losses=(), *, calls=None, shapes=None, roles=None) -> FakeRun:
    want = tp.tp_collectives(lesson.N_LAYER, nproc, sp)
    counted = calls or {p: {NAMES[c]: n for c, n in ops.items()} for p, ops in want.items()}
    shards = shapes or {n: list(tp.shard_shape(tuple(s), tp.shard_dim(n), nproc)) for n, s in FULL.items()}
    by_rank = {r: {"tp_comm_calls": counted, "shard_shapes": shards, "dp_rank": (roles or {}).get(r, (0, r))[0],
                   "tp_rank": (roles or {}).get(r, (0, r))[1], "dp_degree": 1, "tp_degree": nproc}
               for r in range(nproc)}
    return FakeRun(by_rank, losses)


CURVE = [3.4, 3.0, 2.7, 2.5]
NEAR = [v + 1e-7 for v in CURVE]  # an fp32 ordering's drift
EXACT = [v + 1e-16 for v in CURVE]


def runs(nproc=2, tp_curve=NEAR, tp64=EXACT):
    return {"one process": tp_run(1, False, CURVE), "one process fp64": tp_run(1, False, EXACT),
            "TP": tp_run(nproc, False, tp_curve), "TP fp64": tp_run(nproc, False, tp64),
            "TP+SP": tp_run(nproc, True, NEAR), "TP+SP fp64": tp_run(nproc, True, EXACT)}


@pytest.mark.parametrize("nproc", [1, 2, 3, 4, 6, 12])
def test_every_tp_degree_that_splits_the_heads_is_accepted(nproc):
    assert lesson.resolve("smoke", 0, nproc).nproc == nproc


def test_a_degree_that_does_not_split_the_heads_is_refused_with_the_ones_that_do():
    with pytest.raises(ValueError, match="use one of 1, 2, 3, 4, 6, 12"):
        lesson.resolve("smoke", 0, 5)
    assert lesson.resolve("smoke", 0).nproc == 2 and lesson.resolve("full", 8).nproc == 2  # 8 GPUs: 12 % 8


def test_nproc_one_is_explained_not_refused(capsys, monkeypatch):
    from helpers.notebook import env
    monkeypatch.setattr(env, "gpu_count", lambda: 0)
    lesson.settings("smoke", 1)
    assert "NPROC=1" in capsys.readouterr().out


@pytest.mark.parametrize("nproc", [1, 2, 3, 4])
def test_runs_as_the_formula_says_make_every_claim_true(capsys, nproc):
    cfg = lesson.resolve("smoke", 0, nproc, steps=4)
    got = runs(nproc)
    lesson.claim_losses(got, cfg)
    lesson.claim_comms(got, cfg)
    lesson.claim_shards(got["TP"], FULL, nproc)
    found = verdicts(capsys)
    assert found and all(found.values()), found


def test_a_curve_many_floors_away_is_refused(capsys):
    """A bug in the TP code moves the fp32 run and its fp64 twin alike: both claims must say False."""
    cfg = lesson.resolve("smoke", 0, 2, steps=4)
    lesson.claim_losses(runs(tp_curve=[v + 1e-3 for v in NEAR], tp64=[v + 1e-3 for v in EXACT]), cfg)
    assert list(verdicts(capsys).values()) == [False, False]
    lesson.claim_losses(runs(tp64=[v + 1e-9 for v in CURVE]), cfg)  # fp64 off by far more than 2^-29 floors
    assert [v for c, v in verdicts(capsys).items() if c.startswith("in fp64")] == [False]


def test_one_collective_more_than_the_formula_is_refused(capsys):
    cfg = lesson.resolve("smoke", 0, 2, steps=4)
    got = runs()
    extra = {"forward": {"all_reduce": 5}, "backward": {"all_reduce": 4}, "grad_sync": {}}
    got["TP"] = tp_run(2, False, NEAR, calls=extra)
    lesson.claim_comms(got, cfg)
    assert list(verdicts(capsys).values()) == [False]


def test_a_parameter_split_along_the_wrong_dimension_is_refused(capsys):
    shapes = {n: list(tp.shard_shape(tuple(s), tp.shard_dim(n), 2)) for n, s in FULL.items()}
    shapes["blocks.0.attn.q.weight"] = [96, 48]
    lesson.claim_shards(tp_run(2, False, shapes=shapes), FULL, 2)
    assert list(verdicts(capsys).values()) == [False]


def test_a_2d_mesh_missing_a_pair_is_refused(capsys):
    one = runs()
    curves = {label: lesson.global_losses(run) for label, run in one.items()}
    twice = {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 0)}
    two = {"FSDP2 x TP": tp_run(4, False, NEAR, roles=twice), "FSDP2 x TP fp64": tp_run(4, False, EXACT)}
    lesson.claim_2d(two, curves)
    found = verdicts(capsys)
    assert found["the 4 ranks cover the 2 x 2 mesh once each: every (dp rank, tp rank) pair"] is False


def test_detail_claim_needs_the_detail_level_every_step_and_a_clean_exit(capsys):
    cfg = lesson.resolve("smoke", 0, 2, steps=4)
    lesson.claim_detail(tp_run(2, False, CURVE), cfg)
    lesson.claim_detail(FakeRun(tp_run(2, False).results_by_rank(), CURVE[:2]), cfg)
    lesson.claim_detail(FakeRun(tp_run(2, False).results_by_rank(), CURVE, returncode=1), cfg)
    lesson.claim_detail(FakeRun(tp_run(2, False).results_by_rank(), CURVE, log="debug=OFF"), cfg)  # env not passed on
    found = checks.parse(capsys.readouterr().out)
    assert [v for _, v in found] == [True, False, False, False]
    assert "on 2 gloo ranks" in found[0][0]
    assert "on 2 nccl ranks" in lesson.resolve("smoke", 2, 2, steps=4).backend.join(["on 2 ", " ranks"])
    lesson.claim_detail(tp_run(4, False, CURVE), lesson.resolve("smoke", 2, 2, steps=4), ranks=4, label="2-D")
    assert "2-D on 4 gloo ranks" in checks.parse(capsys.readouterr().out)[0][0]  # 2 GPUs: the 4 ranks ran on CPU


def test_the_two_by_two_section_runs_cpu_ranks_where_the_gpus_are_too_few():
    assert lesson.resolve("smoke", 0, 2).env_for(4) == {}  # CPU machine: gloo already
    assert lesson.resolve("smoke", 2, 2).env_for(4) == {"CUDA_VISIBLE_DEVICES": ""}
    assert lesson.resolve("smoke", 4, 4).env_for(4) == {}
    assert lesson.resolve("smoke", 2, 2).env_for(2) == {}  # enough GPUs


def test_the_script_claims_hold_for_the_course_scripts(capsys):
    lesson.claim_script_changes()
    found = verdicts(capsys)
    assert found and all(found.values()), found


def test_the_refusals_are_refused_before_anything_starts(capsys):
    lesson.claim_refusals(2)
    assert list(verdicts(capsys).values()) == [True]


def saved_runs(nproc: int, cfg, sp_saved=None) -> dict:
    """The three runs with each block's saved bytes as the formula gives them (``sp_saved``: TP+SP's instead)."""
    from helpers.calc import activations

    def saved(t, sp):
        return activations.layer_bytes(lesson.SEQ_LEN, cfg.batch, lesson.D_MODEL, lesson.HEADS, tp=t, sp=sp,
                                       gathered_whole=True)
    out = {}
    for label, t, sp in (("one process", 1, False), ("TP", nproc, False), ("TP+SP", nproc, True)):
        run = tp_run(t, sp)
        for res in run.results_by_rank().values():
            res["tp_saved_bytes"] = [sp_saved if sp and sp_saved is not None else saved(t, sp)] * lesson.N_LAYER
        out[label] = run
    return out


@pytest.mark.parametrize("nproc", [1, 2, 4])
def test_the_activation_claim_holds_at_the_formula_and_fails_for_megatrons_count(nproc, capsys):
    """torch's SP plan saves the all-gathered inputs whole; a run that held Megatron's count (everything / t) or
    the TP count would contradict the claim, as would one block that differs from the others."""
    from helpers.calc import activations

    cfg = lesson.resolve("smoke", 0, nproc)
    rows = lesson.claim_activations(saved_runs(nproc, cfg), cfg)
    assert list(verdicts(capsys).values()) == [True]
    sbh = 4 * lesson.SEQ_LEN * cfg.batch * lesson.D_MODEL
    tp_row, sp_row = rows[1], rows[2]
    stats = 4 * 4 * lesson.SEQ_LEN * cfg.batch  # the LayerNorms' mean and 1/std, sharded too
    assert tp_row["formula"] - sp_row["formula"] == pytest.approx((2 * sbh + stats) * (1 - 1 / nproc))  # SP's saving
    assert sp_row["formula"] - sp_row["megatron"] == pytest.approx(2 * sbh * (1 - 1 / nproc))  # what torch keeps
    if nproc > 1:
        megatron = activations.layer_bytes(lesson.SEQ_LEN, cfg.batch, lesson.D_MODEL, lesson.HEADS, tp=nproc, sp=True)
        lesson.claim_activations(saved_runs(nproc, cfg, sp_saved=megatron), cfg)
        assert list(verdicts(capsys).values()) == [False]
    uneven = saved_runs(nproc, cfg)
    uneven["TP"].results_by_rank()[0]["tp_saved_bytes"][-1] += 64
    lesson.claim_activations(uneven, cfg)
    assert list(verdicts(capsys).values()) == [False]
