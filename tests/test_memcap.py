"""The memory cap (helpers/rank/memcap.py) and notebook 07's memory-cap lesson (helpers/notebook/lessons/memcap.py).

Fast: the cap's arithmetic, the rank-side message and allocation-failure test, the limit really set in a child
process and an allocation past it failing with the named error. Slow: the three launches, DDP stopped by the cap
with the named error, ZeRO-3 and FSDP2 trained within it.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from helpers.calc.memory import zero_model_state_bytes
from helpers.notebook.lessons import memcap as lesson
from helpers.rank import memcap

MIB = 2**20


def test_needs_follow_the_zero_formula_with_each_frameworks_k():
    need = lesson.needs_bytes(1e6, 2)
    assert need == {"DDP": 16e6, "ZeRO-3": 10e6, "FSDP2": 8e6}
    assert need["DDP"] == zero_model_state_bytes(1e6, 2, 0, "fp32")["total"]


def test_sharded_peaks_add_the_whole_model_built_before_sharding():
    assert lesson.peaks_bytes(1e6, 4) == {"DDP": 16e6, "ZeRO-3": 4e6 + 5e6, "FSDP2": 4e6 + 4e6}


@pytest.mark.parametrize("nproc", [3, 4])
def test_cap_lies_between_sharded_and_unsharded_peak_by_the_allowance(nproc):
    allowance = 64 * MIB
    params = lesson.params_for(nproc, allowance)
    peak = lesson.peaks_bytes(params, nproc)
    cap = lesson.cap_bytes(params, nproc, allowance)
    assert peak["DDP"] - cap == pytest.approx(allowance)             # DDP: one allowance above the cap
    assert cap - peak["ZeRO-3"] == pytest.approx(3 * allowance)      # the larger sharded peak: three below
    assert cap - peak["FSDP2"] > cap - peak["ZeRO-3"]


@pytest.mark.parametrize("asked", [1, 2])
def test_fewer_than_three_ranks_are_refused_by_the_arithmetic_and_planned_on_three(asked, capsys):
    with pytest.raises(ValueError, match="from 3 ranks on"):
        lesson.params_for(asked, 64 * MIB)
    plan = lesson.plan(asked, allowance=64 * MIB)
    assert plan.nproc == 3 and plan.asked == asked
    assert "this runs on 3 (at 2" in capsys.readouterr().out


def test_plan_sets_the_cap_and_the_need_for_the_ranks():
    plan = lesson.plan(3, allowance=64 * MIB)
    env = plan.env("FSDP2")
    assert float(env["COURSE_MEMORY_CAP_MIB"]) == pytest.approx(plan.cap_mib, abs=0.5)
    assert float(env["COURSE_MEMORY_NEED_MIB"]) == pytest.approx(plan.need_mib["FSDP2"], abs=0.5)
    assert plan.peak_mib["ZeRO-3"] < plan.cap_mib < plan.need_mib["DDP"]


def test_stack_bytes_reads_rlimit_stack():
    soft, _ = __import__("resource").getrlimit(__import__("resource").RLIMIT_STACK)
    assert lesson.stack_bytes() == (lesson.DEFAULT_STACK if soft in (-1, __import__("resource").RLIM_INFINITY)
                                    else soft)


def test_message_names_rank_cap_and_formula():
    text = memcap.message(1, 250, 612.4, 320.1)
    assert text.startswith("rank 1: out of memory within the cap of 250 MiB")
    assert "~320 MiB by the formula" in text and lesson.NAMED_ERROR in text
    assert "formula" not in memcap.message(0, 250, 612.4, None)


def test_allocation_failures_are_recognised_and_other_errors_are_not():
    assert memcap.is_allocation_failure(MemoryError())
    assert memcap.is_allocation_failure(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried ..."))
    wrapped = ValueError("later")
    wrapped.__cause__ = RuntimeError("[enforce fail at alloc_cpu.cpp:119] err == 0. Cannot allocate memory")
    assert memcap.is_allocation_failure(wrapped)
    assert not memcap.is_allocation_failure(RuntimeError("Boolean value of Tensor is ambiguous"))
    assert not memcap.is_allocation_failure(KeyError("x"))


def test_no_variable_no_cap():
    assert memcap.apply_from_env(0, environ={}) is None


def _child(code: str, cap_mib: str, tmp_path):
    env = dict(os.environ, COURSE_MEMORY_CAP_MIB=cap_mib, COURSE_MEMORY_NEED_MIB="300", RANK="0",
               TORCHELASTIC_ERROR_FILE=str(tmp_path / "error.json"))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_DATA is enforced on Linux")
def test_a_tensor_past_the_cap_fails_with_the_named_error(tmp_path):
    done = _child("""
        import json, os, resource, torch
        from helpers.rank import memcap
        state = memcap.apply_from_env()
        soft, _ = resource.getrlimit(resource.RLIMIT_DATA)
        assert abs(soft / 2**20 - state["baseline_mib"] - 64) < 1, (soft, state)
        small = torch.ones(4 * 2**20 // 4)          # 4 MiB: within the cap
        big = torch.ones(256 * 2**20 // 4)          # 256 MiB: past it
    """, "64", tmp_path)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("RankOutOfMemory: rank 0: out of memory within the cap of 64 MiB"), done.stderr[-2000:]
    assert "~300 MiB by the formula" in last
    assert "can't allocate memory" in done.stderr  # the allocator's own error stays in the traceback
    import json
    recorded = json.loads((tmp_path / "error.json").read_text())["message"]
    assert "RankOutOfMemory" in recorded["message"] and "DefaultCPUAllocator" in recorded["extraInfo"]["py_callstack"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_DATA is enforced on Linux")
def test_other_errors_keep_their_own_message_under_the_cap(tmp_path):
    done = _child("""
        from helpers.rank import memcap
        memcap.apply_from_env()
        raise ValueError("not a memory problem")
    """, "64", tmp_path)
    assert done.stderr.strip().splitlines()[-1] == "ValueError: not a memory problem"


def _fake_run(states_mib, steps=lesson.STEPS, returncode=0):
    records = [{"kind": "step", "rank": 0, "step": s} for s in range(1, steps + 1)]
    return SimpleNamespace(returncode=returncode, metrics=records,
                           results_by_rank=lambda: {0: {"model_state_bytes": {"total": states_mib * MIB}}})


def _plan():
    return lesson.Plan(nproc=3, asked=2, params=50_143_114, width=1728, allowance_mib=64, cap_mib=702,
                       need_mib={"DDP": 765, "ZeRO-3": 319, "FSDP2": 255},
                       peak_mib={"DDP": 765, "ZeRO-3": 510, "FSDP2": 446})


def test_claims_hold_for_the_expected_outcome(capsys):
    from helpers.launch import LaunchError
    outcome = {"DDP": LaunchError("rank 0 failed ... RankOutOfMemory: rank 0: out of memory within the cap of 702 MiB"),
               "ZeRO-3": _fake_run(320), "FSDP2": _fake_run(256)}
    assert all(lesson.claim_outcome(_plan(), outcome).values())
    assert "False" not in capsys.readouterr().out


def test_claims_say_false_when_ddp_trains_or_fails_otherwise_or_a_sharded_run_stops():
    from helpers.launch import LaunchError
    good = {"ZeRO-3": _fake_run(320), "FSDP2": _fake_run(256)}
    assert not lesson.claim_outcome(_plan(), {**good, "DDP": _fake_run(765)})["ddp_stopped"]
    assert not lesson.claim_outcome(_plan(), {**good, "DDP": LaunchError("rank 1 failed: KeyError")})["ddp_stopped"]
    oom = LaunchError("out of memory within the cap of 702 MiB")
    stopped = lesson.claim_outcome(_plan(), {"DDP": oom, "ZeRO-3": oom, "FSDP2": _fake_run(256)})
    assert not stopped["sharded_trained"] and not stopped["states_below_cap"]
    short = lesson.claim_outcome(_plan(), {"DDP": oom, "ZeRO-3": _fake_run(320, steps=1), "FSDP2": _fake_run(256)})
    assert not short["sharded_trained"]
    over = lesson.claim_outcome(_plan(), {"DDP": oom, "ZeRO-3": _fake_run(800), "FSDP2": _fake_run(256)})
    assert over["sharded_trained"] and not over["states_below_cap"]


@pytest.mark.slow
def test_ddp_stops_at_the_cap_and_zero3_and_fsdp2_train_within_it(capsys):
    plan = lesson.plan(2)
    outcome = lesson.run(plan)
    verdicts = lesson.claim_outcome(plan, outcome)
    assert verdicts == {"ddp_stopped": True, "sharded_trained": True, "states_below_cap": True}, \
        {k: str(v)[-1500:] for k, v in outcome.items()}
    assert f"cap of {plan.cap_mib:.0f} MiB" in str(outcome["DDP"])


def test_named_line_is_found_in_a_launch_error_and_shown(capsys):
    from helpers.launch import LaunchError
    error = LaunchError("rank 2 failed (exit code 1)\n--- traceback ---\nRuntimeError: DefaultCPUAllocator: can't "
                        "allocate memory\nhelpers.rank.memcap.RankOutOfMemory: rank 2: out of memory within the cap "
                        "of 702 MiB (above its start-up footprint of 950 MiB; model states need ~765 MiB by the formula)")
    assert lesson.named_line(error).startswith("rank 2: out of memory within the cap of 702 MiB")
    assert lesson.named_line(LaunchError("rank 0 failed: KeyError")) is None
    lesson.show({"DDP": error})
    assert "DDP     stopped: rank 2: out of memory within the cap" in capsys.readouterr().out
