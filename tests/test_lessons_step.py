"""Notebook 11 (inside a step): its settings refuse what cannot run; its claims say True on traces whose timing is
what the prose says and False when a fault is injected (a bucket that waits for the backward, a second gather
missing, a TP all-reduce nobody waits for, a model that overprices); the byte formulas behind the predictions; and
(slow) the six modes of course/overlap.py and the traced sweep on real ranks."""
from __future__ import annotations

import json
import statistics

import pytest

from helpers.calc import comm
from helpers.calc import traces as calc
from helpers.notebook import checks
from helpers.notebook import traces as nb_traces
from helpers.notebook.lessons import comm_model
from helpers.notebook.lessons import step as lesson

LAYER = 1024 * 1025 * 4  # bytes of one 1024 x 1024 layer with its bias, fp32


def verdicts(capsys) -> dict[str, bool]:
    return dict(checks.parse(capsys.readouterr().out))


def event(name, ts, dur, tid=1, cat="cpu_op"):
    return {"ph": "X", "name": name, "cat": cat, "pid": 1, "tid": tid, "ts": ts, "dur": dur}


class FakeRun:
    """A run folder with one trace per rank and a result.json, read the way a real Run is."""

    def __init__(self, tmp_path, name: str, per_rank: dict[int, list[dict]], result: dict):
        self.run_dir = tmp_path / name
        self.run_dir.mkdir()
        for rank, events in per_rank.items():
            (self.run_dir / f"trace_rank{rank}.json").write_text(json.dumps({"traceEvents": events}))
        self.result = result


def ddp_step(t0: float, comm_at: float, comm_dur: float, *, calls: int = 1, step_dur: float = 1000.0) -> list[dict]:
    """One step: forward+backward compute 0-600 (backward from 200), the optimizer at 950-990 us; ``calls``
    all-reduces of ``comm_dur`` each from ``comm_at`` on, one after the other, on gloo's thread."""
    events = [event("ProfilerStep#1", t0, step_dur, cat="user_annotation"), event("aten::mm", t0, 200),
              event("autograd::engine::evaluate_function: MmBackward0", t0 + 200, 400),
              event("Optimizer.step#SGD.step", t0 + 950, 40)]
    for k in range(calls):
        events.append(event("gloo:all_reduce", t0 + comm_at + k * comm_dur, comm_dur, tid=2, cat="user_annotation"))
    return events


def ddp_runs(tmp_path, *, buckets_at: float = 250.0, nproc: int = 2) -> dict[str, FakeRun]:
    """The three DDP modes: buckets from ``buckets_at`` (inside the backward unless moved past 600), one bucket and
    no overlap after the backward."""
    def steps(**kw):
        return {r: ddp_step(0, **kw) + ddp_step(2000, **kw) for r in range(nproc)}

    res = dict(world_size=nproc, grad_mib=8 * LAYER / 2 ** 20)
    return {"buckets": FakeRun(tmp_path, "b", steps(comm_at=buckets_at, comm_dur=40, calls=8),
                               dict(res, ddp_sync="buckets", ddp_buckets=[LAYER] * 8)),
            "one-bucket": FakeRun(tmp_path, "o", steps(comm_at=610, comm_dur=250),
                                  dict(res, ddp_sync="one-bucket", ddp_buckets=[8 * LAYER])),
            "no-overlap": FakeRun(tmp_path, "n", steps(comm_at=620, comm_dur=250),
                                  dict(res, ddp_sync="no-overlap", ddp_buckets=[]))}


def test_settings_refuse_rank_counts_the_chapter_cannot_run():
    for bad in (0, 5, 2.5, "2"):
        with pytest.raises(ValueError, match="NPROC"):
            lesson.resolve("smoke", 2, bad)
    cfg = lesson.resolve("smoke", 2, None)
    assert cfg.nproc == 2 and cfg.own_cores and not lesson.resolve("smoke", 2, 3).own_cores
    args = [str(a) for a in cfg.args("fsdp2-keep")]
    assert args[args.index("--profile-steps") + 1] == "5" and args[args.index("--mode") + 1] == "fsdp2-keep"
    with pytest.raises(ValueError, match="mode"):
        cfg.args("zero-3")


def test_bucketing_claims_hold_on_overlapping_traces_and_fail_when_the_buckets_wait(tmp_path, capsys):
    cfg = lesson.resolve("smoke", 2, 2)
    runs = ddp_runs(tmp_path)
    lesson.claim_buckets(runs, cfg)
    lesson.claim_overlap(runs, cfg)
    got = verdicts(capsys)
    assert len(got) == 5 and all(got.values()), got
    (tmp_path / "late").mkdir()
    late = ddp_runs(tmp_path / "late", buckets_at=610)
    lesson.claim_overlap(late, cfg)  # the fault: buckets that start only after the backward
    got = verdicts(capsys)
    assert [ok for text, ok in got.items() if text.startswith("buckets")] == [False]
    assert [ok for text, ok in got.items() if text.startswith("with a core")] == [False]


def test_exposed_time_is_not_compared_when_ranks_share_cores(tmp_path, capsys):
    lesson.claim_overlap(ddp_runs(tmp_path, nproc=3), lesson.resolve("smoke", 2, 3))
    out = capsys.readouterr().out
    assert "take turns" in out and not any(t.startswith("with a core") for t, _ in checks.parse(out))


def fsdp_step(t0: float, gathers: int, reduces: int, waited: bool = True) -> list[dict]:
    """FSDP2 on a CPU: each collective inside the main-thread span that waits for it (unless ``waited`` is False:
    the fault, collectives running beside compute)."""
    events = [event("ProfilerStep#1", t0, 1000, cat="user_annotation"), event("aten::mm", t0, 900)]
    for k in range(gathers):
        events += [event("gloo:all_gather", t0 + 10 * k, 5, tid=2)]
        events += [event(f"FSDP::all_gather ({k})", t0 + 10 * k - 1, 7)] if waited else []
    for k in range(reduces):
        events += [event("gloo:all_reduce", t0 + 500 + 10 * k, 5, tid=2)]
        events += [event(f"FSDP::post_backward_reduce ({k})", t0 + 500 + 10 * k - 1, 7)] if waited else []
    return events


def fsdp_runs(tmp_path, keep_gathers: int = 8, waited: bool = True) -> dict[str, FakeRun]:
    res = dict(world_size=2, grad_mib=8 * LAYER / 2 ** 20)
    plan = {"fsdp2": 16, "fsdp2-keep": keep_gathers, "fsdp2-prefetch": 16}
    return {mode: FakeRun(tmp_path, mode, {r: fsdp_step(0, g, 8, waited) + fsdp_step(2000, g, 8, waited)
                                           for r in range(2)}, dict(res, ddp_sync=mode)) for mode, g in plan.items()}


def test_fsdp_claims_count_the_gathers_and_fail_on_a_second_gather_that_should_be_gone(tmp_path, capsys):
    cfg = lesson.resolve("smoke", 2, 2)
    lesson.claim_fsdp(ddp_runs(tmp_path) | fsdp_runs(tmp_path), cfg)  # DDP's no-overlap and buckets: the floors
    got = verdicts(capsys)
    assert len(got) == 4 and all(got.values()), got
    for fault, kw, verdict in (("keep", dict(keep_gathers=16), [True, False, True, True]),
                               ("overlap", dict(waited=False), [True, True, True, False])):
        (tmp_path / fault).mkdir()
        lesson.claim_fsdp(ddp_runs(tmp_path / fault) | fsdp_runs(tmp_path / fault, **kw), cfg)
        assert list(verdicts(capsys).values()) == verdict, fault


def tp_run(tmp_path, name: str, waits: int, mm_at: float = 30) -> FakeRun:
    """TP's 8 all-reduces a step, each read by an ``aten::add`` that starts 1 us after it and waits for it from 5 us
    in (DTensor's dispatch before the wait: what the hidden column counts), and a matmul ``mm_at`` us after each
    all-reduce starts (after it ends by default; inside it, an injected fault)."""
    events = []
    for t0 in (0, 2000):
        events += [event("ProfilerStep#1", t0, 1000, cat="user_annotation")]
        events += [event("gloo:all_reduce", t0 + 100 * k, 20, tid=2) for k in range(8)]
        events += [event("aten::add", t0 + 100 * k + 1, 20) for k in range(8)]
        events += [event("_c10d_functional::wait_tensor", t0 + 100 * k + 5, 15) for k in range(waits)]
        events += [event("aten::mm", t0 + 100 * k + mm_at, 3) for k in range(8)]
    return FakeRun(tmp_path, name, {0: events, 1: events},
                   dict(framework="tp", world_size=2, gpt={"n_layer": 2, "seq_len": 48, "d_model": 96},
                        global_batch=8, dp_degree=1,
                        tp_comm_calls={"forward": {"all_reduce": 4}, "backward": {"all_reduce": 4}}))


def zero3_runs(tmp_path, *, nopf_at: float = 610.0, nproc: int = 2) -> dict:
    """ZeRO-3's two runs as ddp_step draws them: the defaults gather during the compute, without prefetch from
    ``nopf_at`` (after it)."""
    def steps(comm_at):
        return {r: [dict(e, name="gloo:all_gather") if e["name"] == "gloo:all_reduce" else e
                    for e in ddp_step(0, comm_at, 100) + ddp_step(2000, comm_at, 100)] for r in range(nproc)}

    res = dict(world_size=nproc, framework="deepspeed", zero_stage=3)
    return {"zero3": FakeRun(tmp_path, "z", steps(250), res),
            "no-prefetch": FakeRun(tmp_path, "zp", steps(nopf_at), res)}


def test_zero3_knob_claims_hold_and_fail_when_their_fault_is_injected(tmp_path, capsys, monkeypatch):
    cfg = lesson.resolve("smoke", 2, 2)
    (tmp_path / "ddp").mkdir()
    ddp = ddp_runs(tmp_path / "ddp")
    lesson.claim_zero3_knobs(zero3_runs(tmp_path), ddp, cfg)
    assert list(verdicts(capsys).values()) == [True, True]
    (tmp_path / "a").mkdir()
    lesson.claim_zero3_knobs(zero3_runs(tmp_path / "a", nopf_at=250), ddp, cfg)  # the fault: no-prefetch overlaps
    assert list(verdicts(capsys).values()) == [True, False]
    lesson.claim_zero3_knobs({}, {}, lesson.resolve("smoke", 2, 1))
    out = capsys.readouterr().out
    assert "NPROC=1" in out and [v for _, v in checks.parse(out)] == [True]  # the accelerator's fact still holds
    monkeypatch.setattr(lesson, "cpu_streams", lambda: {"Stream": object, "current_stream()": object()})
    (tmp_path / "b").mkdir()
    lesson.claim_zero3_knobs(zero3_runs(tmp_path / "b"), ddp, cfg)  # the fault: an accelerator with a stream
    assert list(verdicts(capsys).values()) == [False, True]


def test_zero3_configs_are_notebook_03s_at_stage_3_with_one_knob_off():
    base = json.loads(lesson.DS_CONFIG.read_text())
    assert lesson.zero3_config("zero3")["zero_optimization"] == dict(base["zero_optimization"], stage=3)
    assert lesson.zero3_config("no-prefetch")["zero_optimization"]["stage3_prefetch_bucket_size"] == 0
    assert sorted(lesson.ZERO3_MODES) == ["no-prefetch", "zero3"]
    assert lesson.zero3_config("zero3")["optimizer"] == base["optimizer"]
    with pytest.raises(ValueError, match="one of"):
        lesson.zero3_config("zero-3")


def test_zero3_defaults_are_read_from_deepspeeds_config_model():
    line = lesson.zero3_defaults()
    assert "overlap_comm=True" in line and "stage3_prefetch_bucket_size=50,000,000" in line


def test_tp_claims_count_the_all_reduces_and_their_waits(tmp_path, capsys):
    cfg = lesson.resolve("smoke", 2, 2)
    lesson.claim_tp(tp_run(tmp_path, "tp", waits=8), cfg)
    assert list(verdicts(capsys).values()) == [True, True, True]
    lesson.claim_tp(tp_run(tmp_path, "tp_unwaited", waits=7), cfg)
    assert list(verdicts(capsys).values())[:2] == [True, False]
    lesson.claim_tp(tp_run(tmp_path, "tp_mm", waits=8, mm_at=2), cfg)  # a matmul while an all-reduce runs
    assert list(verdicts(capsys).values()) == [True, True, False]


def test_the_byte_formulas_list_each_configurations_collectives(tmp_path):
    runs = ddp_runs(tmp_path) | fsdp_runs(tmp_path)
    assert comm_model.calls_of(runs["buckets"]) == [("all_reduce", LAYER)] * 8
    assert comm_model.calls_of(runs["no-overlap"]) == [("all_reduce", pytest.approx(8 * LAYER))]
    keep = comm_model.calls_of(runs["fsdp2-keep"])
    assert keep.count(("all_gather", LAYER / 2)) == 8 and keep.count(("reduce_scatter", LAYER)) == 8
    assert len(comm_model.calls_of(runs["fsdp2"])) == 24
    assert comm_model.calls_of(tp_run(tmp_path, "tp", 8)) == [("all_reduce", 8 * 48 * 96 * 4)] * 8
    runs["buckets"].result["world_size"] = 1
    assert comm_model.calls_of(runs["buckets"]) == []


def test_zero_1_and_2_are_priced_from_the_parameters_and_the_ds_config_they_ran(tmp_path):
    def ds_run(name, stage, nproc=2, config=None, **result):
        run = FakeRun(tmp_path, name, {}, dict(framework="deepspeed", zero_stage=stage, world_size=nproc,
                                               params=1000, dtype="fp32") | result)
        if config is not None:
            (run.run_dir / "deepspeed_config.json").write_text(json.dumps(config))
        return run

    clipped = lesson.zero_config(2)
    assert clipped["gradient_clipping"] > 0  # notebook 03's ds_config clips: one all-reduce of the norm
    assert comm_model.calls_of(ds_run("z1", 1, config=clipped)) == [("all_reduce", 4000), ("all_reduce", 4),
                                                                     ("all_gather", 2000)]
    unclipped = dict(clipped, gradient_clipping=0.0)
    assert comm_model.calls_of(ds_run("z2", 2, nproc=4, config=unclipped)) == [("all_reduce", 4000),
                                                                                ("all_gather", 1000)]
    assert comm_model.calls_of(ds_run("one", 2, nproc=1, config=clipped)) == []
    for name, stage, config, result, match in (("z3", 3, clipped, {}, "ZeRO-3 is not priced"),
                                               ("bf", 2, clipped, dict(dtype="bf16"), "fp32 only"),
                                               ("path", 2, None, {}, "as a dict")):
        with pytest.raises(ValueError, match=match):
            comm_model.calls_of(ds_run(name, stage, config=config, **result))
    assert lesson.zero_config(1, overlap_comm=True)["zero_optimization"] == dict(stage=1, overlap_comm=True)


def sweep_run(tmp_path, rs_name: str = "gloo:all_reduce") -> FakeRun:
    """A traced sweep of all_reduce and reduce_scatter, each exactly alpha + bytes / bandwidth."""
    events, t = [], 0.0
    for op, name, alpha, bw in (("all_reduce", "gloo:all_reduce", 100.0, 1e3), ("reduce_scatter", rs_name, 100.0,
                                                                                  1e3)):
        for size in (1e5, 1e6, 1e7):
            for _ in range(3):
                dur = alpha + size / bw  # microseconds: 1e3 bytes per us = 1 GB/s
                events += [event(f"sweep {op} {int(size)}", t, dur + 20), event(name, t + 10, dur, tid=2)]
                t += dur + 100
    return FakeRun(tmp_path, "sweep" + rs_name[-3:], {0: events, 1: events}, {})


def test_the_model_is_fitted_from_the_sweeps_spans_and_claimed_as_a_floor(tmp_path, capsys):
    sweep = sweep_run(tmp_path)
    model = comm_model.fits(sweep)
    assert model["all_reduce"]["alpha"] == pytest.approx(100e-6) and model["all_reduce"]["bandwidth"] == \
        pytest.approx(1.0)
    table = [dict(config="no-overlap", calls=1, predicted=1.0, measured=1.1, ratio=1.1, hidden=0.0),
             dict(config="buckets", calls=8, predicted=1.0, measured=3.0, ratio=3.0, hidden=0.6)]
    comm_model.claim_model(model, table, sweep)
    assert list(verdicts(capsys).values()) == [True, True]
    comm_model.claim_model(model, table, sweep_run(tmp_path, rs_name="gloo:reduce_scatter"))  # gloo with its own RS
    assert list(verdicts(capsys).values()) == [False, True]
    one = [dict(config="buckets", calls=0, predicted=0.0, measured=20e-6, ratio=None, hidden=None, jitter=1e-3)]
    comm_model.claim_model(model, one, sweep)  # one rank: 20 us a step of collectives of one, steps 1 ms apart
    assert list(verdicts(capsys).values()) == [True, True, True]
    comm_model.claim_model(model, [dict(one[0], measured=2e-3)], sweep)
    assert list(verdicts(capsys).values())[-1] is False


def test_the_sweep_is_read_in_blocks_of_the_profiled_steps(tmp_path):
    events = []
    for k, dur in enumerate((30.0, 10.0, 50.0, 40.0, 20.0, 90.0, 60.0)):  # one size's calls, in order
        events += [event(f"sweep all_reduce {2 ** 21}", 1000 * k, dur + 20), event("gloo:all_reduce", 1000 * k + 10,
                                                                                   dur, tid=2)]
    run = FakeRun(tmp_path, "blocks", {0: events, 1: events}, {})
    assert comm_model.costs(run)["all_reduce"][2 ** 21] == pytest.approx(10e-6)  # the fastest of all 7
    # blocks of 3: (30, 10, 50) and (40, 20, 90); the seventh call fills no block
    assert comm_model.costs(run, block=3)["all_reduce"][2 ** 21] == pytest.approx(15e-6)
    assert comm_model.costs(run, block=1)["all_reduce"][2 ** 21] == pytest.approx(300e-6 / 7)  # every call's mean
    assert comm_model.costs(run, block=9)["all_reduce"][2 ** 21] == pytest.approx(10e-6)  # fewer calls than a block
    with pytest.raises(ValueError, match="block"):
        comm_model.costs(run, block=0)


def test_computing_beside_is_claimed_and_idling_read_with_a_core_per_rank_and_neither_when_ranks_take_turns(tmp_path,
                                                                                                       capsys):
    sweep = gapped_sweep_run(tmp_path)
    model = comm_model.fits(sweep)
    table = [dict(config=c, ratio=r) for c, r in (("buckets", 2.5), ("one-bucket", 1.1), ("no-overlap", 0.8),
                                                  ("fsdp2", 1.3), ("tp", 1.24), ("zero1", None))]
    cfg = lesson.resolve("smoke", 2, 2)
    comm_model.claim_residuals(model, table, sweep, cfg)
    out = capsys.readouterr().out
    assert [v for _, v in checks.parse(out)] == [True]
    assert "a reading, not a claim (measured: 2.00 vs " in out  # idling read: twice the cost, beside the noise
    comm_model.claim_residuals(comm_model.fits(gapped_sweep_run(tmp_path, 1.0)), table, sweep, cfg)
    assert "a reading, not a claim (measured: 1.00 vs " in capsys.readouterr().out  # idling costs nothing: read
    one_slow = [dict(t, ratio=2.6) if t["config"] == "no-overlap" else t for t in table]
    comm_model.claim_residuals(model, one_slow, sweep, cfg)  # one slow moment among three runs alone: the median
    assert list(verdicts(capsys).values()) == [True]
    slow_alone = [dict(t, ratio=2.6) if t["config"] in ("no-overlap", "fsdp2") else t for t in table]
    comm_model.claim_residuals(model, slow_alone, sweep, cfg)
    assert list(verdicts(capsys).values()) == [False]  # the fault: the all-reduces alone are as slow
    comm_model.claim_residuals(model, table, sweep, lesson.resolve("smoke", 2, 3))
    out = capsys.readouterr().out
    assert "take turns" in out and not checks.parse(out)  # 3 ranks on 2 cores: nothing compared
    comm_model.claim_residuals(model, table[3:], sweep, cfg)  # no DDP rows: the idle reading alone
    out = capsys.readouterr().out
    assert not checks.parse(out) and "a reading, not a claim" in out
    comm_model.claim_residuals(model, [dict(config="one", ratio=None)], sweep, cfg)  # one rank: nothing priced
    assert capsys.readouterr().out == ""


def test_nearer_decides_between_two_outcomes():
    assert lesson.nearer(0.9, 1.0, 0.5) and not lesson.nearer(0.7, 1.0, 0.5) and not lesson.nearer(0.75, 1.0, 0.5)


def test_the_sweeps_noise_is_the_gap_between_its_two_fastest_calls(tmp_path):
    assert comm_model.spread(sweep_run(tmp_path)) == pytest.approx(0.0)  # three identical calls of every size
    events = []
    for k, dur in enumerate((1000.0, 1200.0, 3000.0)):  # a 2 MiB all_reduce: 20% between the two fastest
        events += [event(f"sweep all_reduce {2 ** 21}", 5000 * k, dur + 20), event("gloo:all_reduce", 5000 * k + 10,
                                                                                   dur, tid=2)]
    assert comm_model.spread(FakeRun(tmp_path, "noisy", {0: events, 1: events}, {})) == pytest.approx(0.2)


def test_one_bucket_that_hides_like_the_buckets_fails_its_claim(tmp_path, capsys):
    cfg = lesson.resolve("smoke", 2, 2)
    runs = ddp_runs(tmp_path)
    (tmp_path / "x").mkdir()
    runs["one-bucket"] = ddp_runs(tmp_path / "x")["buckets"]  # the fault: the one bucket hides as much
    lesson.claim_overlap(runs, cfg)
    got = verdicts(capsys)
    assert [ok for text, ok in got.items() if text.startswith(("one bucket", "buckets"))] == [False, False]
    assert [ok for text, ok in got.items() if text.startswith("no overlap")] == [True]


def test_one_rank_claims_compare_with_the_runs_own_jitter(tmp_path, capsys):
    cfg = lesson.resolve("smoke", 2, 1)
    runs = ddp_runs(tmp_path, nproc=1)
    lesson.claim_overlap(runs, cfg)  # 250 us of all-reduce a step and steps of equal length: no jitter to hide in
    assert list(verdicts(capsys).values()) == [False]


def test_labelled_costs_take_the_last_arrival_of_each_call():
    spans = calc.spans_of({0: {"traceEvents": [event("sweep a 1", 0, 100), event("gloo:x", 10, 80, tid=2),
                                               event("sweep a 1", 200, 100), event("gloo:x", 210, 30, tid=2)]},
                           1: {"traceEvents": [event("sweep a 1", 0, 100), event("gloo:x", 50, 40, tid=2),
                                               event("sweep a 1", 200, 100), event("gloo:x", 205, 60, tid=2)]}})
    assert calc.labelled_costs(spans, "sweep ") == {"sweep a 1": [pytest.approx(40e-6), pytest.approx(30e-6)]}


def test_fastest_costs_read_each_collective_as_a_sweep_reads_a_size():
    def rank(*steps):  # each step 1000 us, its all-reduces 100 us apart
        events = []
        for i, durs in enumerate(steps):
            events.append(event(f"ProfilerStep#{i}", 1000 * i, 1000, cat="user_annotation"))
            events += [event("gloo:all_reduce", 1000 * i + 100 * k, d, tid=2) for k, d in enumerate(durs)]
        return {"traceEvents": events}

    spans = calc.spans_of({0: rank([50, 10], [40, 70]), 1: rank([20, 30], [60, 25])})
    assert calc.fastest_costs(spans) == [pytest.approx(20e-6), pytest.approx(10e-6)]  # over both steps and ranks
    with pytest.raises(ValueError, match="different numbers"):
        calc.fastest_costs(calc.spans_of({0: rank([50, 10], [40]), 1: rank([20, 30], [60])}))
    with pytest.raises(ValueError, match="different numbers"):
        calc.fastest_costs(calc.spans_of({0: rank([50, 10]), 1: rank([20])}))
    assert calc.fastest_costs(calc.spans_of({0: rank([], [])})) == []
    # in blocks of 2 steps: (50, 10 | 40, 70) on rank 0 and (20, 30 | 60, 25) on rank 1 are one block; with a
    # third and fourth step, a second block, and the costs are the mean of the two blocks' fastest
    four = calc.spans_of({0: rank([50, 10], [40, 70], [90, 90], [80, 95]), 1: rank([20, 30], [60, 25], [70, 99],
                                                                                     [99, 85])})
    assert calc.fastest_costs(four, block=2) == [pytest.approx(45e-6), pytest.approx(47.5e-6)]
    assert calc.fastest_costs(four, block=3) == [pytest.approx(20e-6), pytest.approx(10e-6)]  # the 4th left out
    assert calc.fastest_costs(four, block=9) == calc.fastest_costs(four)  # fewer steps than a block: all of them
    with pytest.raises(ValueError, match="block"):
        calc.fastest_costs(four, block=0)


def test_idle_before_is_the_time_since_the_ranks_previous_collective():
    def rank(offset):  # two steps of 1000 us, all-reduces at 100-150 and 400-420 us of each
        events = []
        for i in range(2):
            events.append(event(f"ProfilerStep#{i}", 1000 * i, 1000, cat="user_annotation"))
            events += [event("gloo:all_reduce", 1000 * i + offset + a, d, tid=2) for a, d in ((100, 50), (400, 20))]
        return {"traceEvents": events}

    spans = calc.spans_of({0: rank(0), 1: rank(10)})
    # per rank: the first call has none before it; then 250, 680 (420 -> 1100) and 250 us
    assert calc.idle_before(spans) == [pytest.approx(x) for x in (0.25, 0.68, 0.25) * 2]
    with pytest.raises(ValueError, match="different numbers"):
        calc.idle_before(calc.spans_of({0: rank(0), 1: {"traceEvents": rank(0)["traceEvents"][:-1]}}))


def gapped_sweep_run(tmp_path, penalty: float = 2.0, gapped=(1e5, 1e6, 1e7)) -> FakeRun:
    """A sweep of all_reduce and all_gather back to back (100 + bytes / 1000 us) and, at the ``gapped`` sizes, after
    30 ms idle (``penalty`` times as long)."""
    events, t = [], 0.0
    for op in ("all_reduce", "all_gather"):
        for size in (1e5, 1e6, 1e7):
            for label, factor in ((f"sweep {op} {int(size)}", 1.0), (f"sweep {op} {int(size)} gap 30", penalty))[
                    :1 + (size in gapped)]:
                for _ in range(3):
                    dur = (100 + size / 1e3) * factor
                    events += [event(label, t, dur + 20), event(f"gloo:{op}", t + 10, dur, tid=2)]
                    t += dur + 100
    return FakeRun(tmp_path, f"gapped{penalty:g}_{len(gapped)}{gapped[-1]:g}", {0: events, 1: events}, {})


def test_sizes_not_timed_after_a_pause_are_priced_back_to_back_above_the_largest_that_was(tmp_path):
    model = comm_model.fits(gapped_sweep_run(tmp_path, gapped=(1e5, 1e6)))  # --gap-max-bytes 1e6
    assert model["all_reduce"]["by_idle"][30.0] == pytest.approx([2 * 200e-6, 2 * 1100e-6, 10100e-6])
    with pytest.raises(ValueError, match="not at"):
        comm_model.fits(gapped_sweep_run(tmp_path, gapped=(1e5, 1e7)))  # a hole below the largest timed size


def test_the_sweep_after_idle_is_kept_beside_the_sweep_back_to_back(tmp_path):
    model = comm_model.fits(gapped_sweep_run(tmp_path))
    assert model["all_reduce"]["alpha"] == pytest.approx(100e-6)  # the line is fitted back to back
    assert sorted(model["all_gather"]["by_idle"]) == [0.0, 30.0]
    assert model["all_gather"]["by_idle"][30.0] == pytest.approx([2 * s for s in model["all_gather"]["seconds"]])
    assert comm_model.costs(gapped_sweep_run(tmp_path, 3.0), idle=30.0)["all_reduce"][10 ** 6] == \
        pytest.approx(3 * 1100e-6)
    assert comm_model.idle_penalty(model) == pytest.approx(2.0)
    back_to_back = comm_model.fits(sweep_run(tmp_path))
    assert back_to_back["all_reduce"]["by_idle"].keys() == {0.0}  # no gap timed
    with pytest.raises(ValueError, match="--gaps-ms"):
        comm_model.idle_penalty(back_to_back, ops=("all_reduce",))


def test_the_residual_table_prices_by_range_and_reads_the_fastest_instances(tmp_path, capsys):
    model = comm_model.fits(gapped_sweep_run(tmp_path))
    runs = ddp_runs(tmp_path)
    table = {t["config"]: t for t in comm_model.show_residuals(model, runs)}
    out = capsys.readouterr().out
    assert "after idle" in out and "traced/model" in out
    calls = comm_model.calls_of(runs["buckets"])
    idle = statistics.median(calc.idle_before(nb_traces.spans(runs["buckets"])))
    assert table["buckets"]["idle"] == pytest.approx(idle)
    assert table["buckets"]["predicted"] == pytest.approx(comm.predict_calls(model, calls, idle=idle))
    assert table["buckets"]["warm"] == pytest.approx(comm.predict_calls(model, calls, local=True))
    assert table["buckets"]["idle"] == 0.0 and table["buckets"]["predicted"] == table["buckets"]["warm"]  # queued
    assert table["no-overlap"]["idle"] > 0 and table["no-overlap"]["predicted"] > table["no-overlap"]["warm"]
    assert table["buckets"]["line"] == pytest.approx(comm.predict_calls(model, calls))
    assert table["buckets"]["measured"] == pytest.approx(sum(calc.fastest_costs(nb_traces.spans(runs["buckets"]))))
    assert table["buckets"]["ratio"] == pytest.approx(table["buckets"]["measured"] / table["buckets"]["predicted"])


# --- real runs ------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_traced_sweep_prices_every_collective(runs_root):
    from helpers import launch

    sweep = launch.torchrun("course/collective_sweep.py", nproc=2, args=["--trace", "--iters", 3, "--max-bytes",
                                                                          2 ** 21, "--gaps-ms", 5, "--gap-iters", 2,
                                                                          "--gap-ops", "all_gather"],
                            name="t_sweep", show="none", timeout=300)
    model = comm_model.fits(sweep)
    assert sorted(model) == sorted(("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv", "send"))
    assert all(f["bandwidth"] > 0 and f["sizes"] == [2 ** 15, 2 ** 17, 2 ** 19, 2 ** 21] for f in model.values())
    assert sorted(model["all_gather"]["by_idle"]) == [0.0, 5.0] and list(model["all_reduce"]["by_idle"]) == [0.0]
    # every call of every size was found inside its label on both ranks (3 timed calls each, 2 after each gap)
    labels = calc.labelled_costs(calc.spans_of(nb_traces.load(sweep)), "sweep ")
    assert len(labels) == 6 * 4 + 4 and all(min(v) > 0 for v in labels.values())
    one_way = calc.labelled_transfers(calc.spans_of(nb_traces.load(sweep)), comm_model.ONE_WAY)
    assert len(one_way) == 4 and all(len(v) == 3 and min(v) > 0 for v in one_way.values())
    assert sorted({len(v) for k, v in labels.items() if "gap" in k}) == [2] and \
        sorted({len(v) for k, v in labels.items() if "gap" not in k}) == [3]


def test_the_sweep_refuses_a_gap_that_is_not_positive_before_any_rank_starts(refused_in_rank, capsys):
    assert refused_in_rank("course/collective_sweep.py", ["--gaps-ms", "0"]) == "2"  # argparse's usage error
    assert "positive number of milliseconds" in capsys.readouterr().err


def pp_step(t0: float, rank: int, late: float = 0.0, recvs: int = 4) -> list[dict]:
    """One 1F1B step of a two-stage pipeline, 4 micro-batches 1000 us apart: rank 0 hands over each activation
    (``c10d::send``) at 100 us into its slot and stage 1's receive, posted at 50 us, ends 60 us after the hand-off
    (``late``: a receive posted 200 us after its message was sent, which then takes 20 us); the gradients
    come back the same way at 500 us, and gloo's own ``gloo:send`` spans open only once the bytes are written."""
    events = [event("ProfilerStep#1", t0, 4000, cat="user_annotation")]
    for m in range(4):
        slot = t0 + 1000 * m
        for at, sender in ((100, 0), (500, 1)):
            if rank == sender:
                events += [event("c10d::send", slot + at, 5), event("gloo:send", slot + at + 40, 5)]
            elif m < recvs:
                posted = slot + (at + 200 if late else at - 50)
                done = posted + 20 if late else slot + at + 60
                events += [event("c10d::recv_", posted - 5, 5), event("gloo:recv", posted, done - posted)]
    return events


def pp_run(tmp_path, name: str, *, nproc: int = 2, late: float = 0.0, recvs: int = 4, **result) -> FakeRun:
    res = dict(framework="pp", world_size=nproc, pp_num_stages=nproc, pp_microbatches=4, global_batch=8,
               dtype="fp32", gpt=dict(seq_len=64, d_model=32)) | result
    return FakeRun(tmp_path, name, {r: pp_step(0, r, late, recvs) + pp_step(5000, r, late, recvs)
                                    for r in range(nproc)}, res)


def test_a_pipelines_messages_are_priced_as_one_way_sends_and_read_from_both_ends(tmp_path):
    run = pp_run(tmp_path, "pp")
    assert comm_model.calls_of(run) == [("send", 2 * 64 * 32 * 4)] * 4  # 8 / 4 per micro-batch x s x h, fp32
    # each receive ends 60 us after its hand-off; gloo's late gloo:send span (40 us on) would read 20 us
    assert comm_model.measured_costs(run) == [pytest.approx(60e-6)] * 4
    assert comm_model.measured_costs(pp_run(tmp_path, "late", late=1.0)) == [pytest.approx(20e-6)] * 4
    for name, kw, match in (("pp3", dict(nproc=3), "two stages"), ("pp_bf16", dict(dtype="bf16"), "fp32 only")):
        with pytest.raises(ValueError, match=match):
            comm_model.calls_of(pp_run(tmp_path, name, **kw))
    with pytest.raises(ValueError, match="name no peer"):
        calc.transfer_costs(traces_of(pp_run(tmp_path, "pp3b", nproc=3)))
    with pytest.raises(ValueError, match="sends but"):
        comm_model.measured_costs(pp_run(tmp_path, "lost", recvs=3))
    assert comm_model.calls_of(pp_run(tmp_path, "one", nproc=1)) == []


def traces_of(run):
    return calc.spans_of(nb_traces.load(run))


def test_the_pipeline_claim_counts_a_message_each_way_per_micro_batch_and_fails_on_a_lost_one(tmp_path, capsys):
    cfg = lesson.resolve("smoke", 2, 2)
    lesson.claim_pp(pp_run(tmp_path, "pp"), cfg)
    assert list(verdicts(capsys).values()) == [True]
    lesson.claim_pp(pp_run(tmp_path, "lost", recvs=3), cfg)
    assert list(verdicts(capsys).values()) == [False]
    assert lesson.resolve("smoke", 2, 4).pp_nproc == 2 and lesson.resolve("smoke", 2, 1).pp_nproc == 1


def test_the_sweeps_one_way_send_is_read_from_its_hand_off_to_the_receives_end():
    spans = calc.spans_of({0: {"traceEvents": [event("sweep send 8", 0, 300), event("c10d::send", 10, 250),
                                               event("gloo:send", 255, 10)]},
                           1: {"traceEvents": [event("sweep send 8", 0, 300), event("gloo:recv", 5, 235)]},
                           2: {"traceEvents": [event("sweep send 8", 0, 300)]}})  # a third rank takes no part
    assert calc.labelled_transfers(spans, "sweep send ") == {"sweep send 8": [pytest.approx(230e-6)]}
    assert calc.labelled_costs(spans, "sweep send ")["sweep send 8"] == [0.0]  # why it is not read as a collective


def test_a_size_the_sweep_timed_slower_than_a_larger_one_is_priced_at_the_larger(tmp_path):
    events, t = [], 0.0
    for size, dur in ((2 ** 17, 970.0), (2 ** 18, 400.0), (2 ** 19, 460.0)):  # us: 128 KiB slowed by something
        for label in (f"sweep all_reduce {size}", f"sweep all_reduce {size} gap 30"):
            for _ in range(3):
                events += [event(label, t, dur + 20), event("gloo:all_reduce", t + 10, dur, tid=2)]
                t += dur + 100
    model = comm_model.fits(FakeRun(tmp_path, "spike", {0: events, 1: events}, {}))
    assert model["all_reduce"]["seconds"][0] == pytest.approx(970e-6)  # the measurement is kept as timed
    call = [("all_reduce", 147 * 1024)]  # between 128 and 256 KiB: priced at the 256 KiB cost, not near 0.9 ms
    assert comm.predict_calls(model, call, local=True) == pytest.approx(400e-6)
    assert comm.predict_calls(model, call, idle=10.0) == pytest.approx(400e-6)


def scaled_sweep_run(tmp_path, name: str, scale: float, second: float = 1.0) -> FakeRun:
    """A sweep of all_reduce back to back, two blocks of 5 calls per size: the first block's fastest ``scale`` x (100
    + bytes / 1000) us, the second block's ``second`` times that."""
    events, t = [], 0.0
    for size in (1e5, 1e6, 2 ** 21, 1e7):
        for k in range(10):
            dur = scale * (100 + size / 1e3) * (second if k >= 5 else 1.0) * (1.0 if k % 5 == 0 else 1.5)
            events += [event(f"sweep all_reduce {int(size)}", t, dur + 20), event("gloo:all_reduce", t + 10, dur,
                                                                                  tid=2)]
            t += dur + 100
    return FakeRun(tmp_path, name, {0: events, 1: events}, {})


def test_the_model_is_claimed_within_the_band_the_sweeps_before_and_after_span(tmp_path, capsys):
    before, after = scaled_sweep_run(tmp_path, "before", 1.0), scaled_sweep_run(tmp_path, "after", 1.3, 1.1)
    assert comm_model.block_spread(before, 5) == pytest.approx(0.0) and \
        comm_model.block_spread(after, 5) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="two blocks"):
        comm_model.block_spread(before, 6)
    run = FakeRun(tmp_path, "no-overlap", {}, dict(world_size=2, ddp_sync="no-overlap", grad_mib=4.0))
    warm = comm.predict_calls(comm_model.fits(before, 5), [("all_reduce", 4 * 2 ** 20)], local=True)
    table = [dict(config="no-overlap", warm=warm, ratio=1.2), dict(config="buckets", warm=warm, ratio=3.0),
             dict(config="fsdp2", warm=warm, ratio=None)]
    rows = comm_model.agreement(table, {"no-overlap": run}, after, 5)
    assert [r["config"] for r in rows] == ["no-overlap"]  # the buckets compute beside theirs; fsdp2 is not priced
    assert rows[0]["drift"] == pytest.approx(1.3 * 1.05) and rows[0]["after"] == pytest.approx(1.3 * 1.05 * warm)
    cfg = lesson.resolve("smoke", 2, 2)
    comm_model.claim_agreement(rows, before, after, cfg)  # a miss of 0.2 within 0.365 of drift + 0.1 of noise
    out = capsys.readouterr().out
    assert [v for _, v in checks.parse(out)] == [True] and "median miss 0.20 vs band 0.36 + 0.10" in out
    comm_model.claim_agreement([dict(rows[0], ratio=1 / 1.5)], before, after, cfg)  # the fault: off by 1.5x
    assert list(verdicts(capsys).values()) == [False]
    comm_model.claim_agreement([dict(rows[0], drift=1.0)], before, before, cfg)  # the fault: a machine that held
    assert list(verdicts(capsys).values()) == [False]  # still, and a model off by 20%
    comm_model.claim_agreement(rows, before, after, lesson.resolve("smoke", 2, 3))
    out = capsys.readouterr().out
    assert "take turns" in out and "median miss 0.20" in out and not checks.parse(out)  # ranks take turns: read
    comm_model.claim_agreement([], before, after, cfg)  # one rank: nothing priced
    assert capsys.readouterr().out == ""


def test_one_launch_of_several_modes_reads_as_one_run_per_mode(tmp_path):
    from helpers import launch

    base = tmp_path / "11_modes"
    for mode in ("buckets", "fsdp2"):
        (base / mode).mkdir(parents=True)
        (base / mode / "metrics.jsonl").write_text(json.dumps(dict(kind="result", rank=0, t=0.0, ddp_sync=mode)))
    run = launch.Run(run_dir=base, returncode=0, duration_s=1.0, command=[], nproc=2, backend="gloo", port=1)
    runs = lesson.by_mode(run)
    assert list(runs) == ["buckets", "fsdp2"] and {m: r.result["ddp_sync"] for m, r in runs.items()} == \
        {"buckets": "buckets", "fsdp2": "fsdp2"} and runs["fsdp2"].run_dir == base / "fsdp2"
    (base / "no-overlap").mkdir()  # a mode that left no result (a rank died before its report)
    with pytest.raises(ValueError, match="no-overlap"):
        lesson.by_mode(run)
    with pytest.raises(ValueError, match="any"):
        lesson.by_mode(launch.Run(run_dir=tmp_path, returncode=0, duration_s=1.0, command=[], nproc=2,
                                  backend="gloo", port=1))
    assert cfg_modes(lesson.resolve("smoke", 2, 2).args(*lesson.MODES)) == list(lesson.MODES)


def cfg_modes(args: list) -> list[str]:
    args = [str(a) for a in args]
    start = args.index("--mode") + 1
    return args[start:start + next(i for i, a in enumerate(args[start:]) if a.startswith("--"))]
