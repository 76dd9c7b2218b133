"""helpers.calc.traces: per-rank profiler traces classified, split per step into compute, communication and exposed
communication, and merged into one Chrome trace with a lane per rank (synthetic traces with known overlaps; the
harness's real traces in tests/test_profile.py)."""
from __future__ import annotations

import pytest

from helpers.calc import traces


def event(name, ts, dur, tid=100, cat="cpu_op", pid=100):
    return {"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": tid, "ts": ts, "dur": dur}


def trace(*events, base=0):
    return {"baseTimeNanoseconds": base, "traceEvents": [{"ph": "M", "name": "process_name", "pid": 100,
                                                          "args": {"name": "python"}}, *events]}


def step_trace(comm_at: float, comm_dur: float = 300.0, base: int = 0):
    """One step of 1000 us: compute 0-400 and 600-1000 on the main thread, one all-reduce on a gloo thread."""
    return trace(event("ProfilerStep#1", 0, 1000, cat="user_annotation"), event("aten::mm", 0, 400),
                 event("autograd::engine::evaluate_function: MmBackward0", 600, 400),
                 event("c10d::allreduce_", 650, 5),  # the hand-off on the main thread: neither compute nor comm
                 event("gloo:all_reduce", comm_at, comm_dur, tid=101, cat="user_annotation"), base=base)


def test_names_say_what_is_communication_compute_and_a_step():
    kinds = {s["name"]: s["kind"] for s in traces.spans(step_trace(300), 0)}
    assert kinds == {"ProfilerStep#1": "step", "aten::mm": "compute", "c10d::allreduce_": "other",
                     "autograd::engine::evaluate_function: MmBackward0": "compute", "gloo:all_reduce": "comm"}
    assert traces.is_comm("nccl:all_reduce") and traces.is_comm("ncclDevKernel_AllReduce_Sum_f32_RING_LL")
    assert not traces.is_comm("aten::add")
    gpu = traces.spans(trace(event("void gemm_kernel", 0, 10, tid=7, cat="kernel")), 0)
    assert gpu[0]["kind"] == "compute"  # a GPU kernel on its stream is compute, whatever thread id it has


@pytest.mark.parametrize("comm_at, exposed", [(300, 200), (400, 200), (450, 150), (0, 0), (700, 0)])
def test_exposed_communication_is_what_no_compute_covers(comm_at, exposed):
    split = traces.step_split(traces.spans_of({0: step_trace(comm_at)}))[0]
    assert len(split) == 1
    row = split[0]
    assert row["span"] == pytest.approx(1000e-6) and row["compute"] == pytest.approx(800e-6)
    assert row["comm"] == pytest.approx(300e-6) and row["exposed"] == pytest.approx(exposed * 1e-6)


def test_a_wait_inside_an_operator_is_not_compute():
    # tensor parallelism: the DTensor waits for its all-reduce inside the first operator that reads the result
    t = trace(event("ProfilerStep#1", 0, 1000, cat="user_annotation"), event("aten::mm", 0, 400),
              event("aten::add", 400, 500), event("_c10d_functional::wait_tensor", 450, 400),
              event("gloo:all_reduce", 380, 470, tid=101, cat="user_annotation"))
    kinds = {s["name"]: s["kind"] for s in traces.spans(t, 0)}
    assert kinds["_c10d_functional::wait_tensor"] == "wait" and kinds["aten::add"] == "compute"
    row = traces.step_split(traces.spans_of({0: t}))[0][0]
    assert row["compute"] == pytest.approx(500e-6)  # 0-450 and 850-900: the add computed before and after its wait
    assert row["exposed"] == pytest.approx(400e-6)  # the whole wait: nothing else ran on the main thread
    fsdp = {"traceEvents": [event("FSDP::post_backward_reduce (2)", 0, 10), event("FSDP::all_gather (4)", 20, 10)]}
    assert {s["kind"] for s in traces.spans(fsdp, 0)} == {"wait"}  # FSDP2's hooks block on their collective
    unwaited = {"traceEvents": [e for e in t["traceEvents"] if e.get("name") != "_c10d_functional::wait_tensor"]}
    assert traces.step_split(traces.spans_of({0: unwaited}))[0][0]["exposed"] == 0  # what counting it as compute hid


def test_interval_arithmetic():
    assert traces.union([(0, 2), (1, 3), (5, 6), (6, 7), (8, 8)]) == [(0, 3), (5, 7)]
    assert traces.minus([(0, 10)], [(2, 3), (5, 7)]) == [(0, 2), (3, 5), (7, 10)]
    assert traces.minus([(0, 2), (4, 6)], [(1, 5)]) == [(0, 1), (5, 6)]
    assert traces.length(traces.clip([(0, 10), (20, 30)], 5, 25)) == 10


def test_merge_gives_each_rank_a_lane_on_one_clock():
    merged = traces.merge({0: step_trace(300, base=1_000_000), 1: step_trace(300, base=2_000_000)})
    names = {e["pid"]: e["args"]["name"] for e in merged["traceEvents"] if e.get("name") == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    starts = {e["pid"]: e["ts"] for e in merged["traceEvents"] if e.get("name") == "ProfilerStep#1"}
    assert starts == {0: 0.0, 1: 1000.0}  # rank 1's file began 1 ms later on the shared clock
    assert all(e["pid"] in (0, 1) for e in merged["traceEvents"])


def test_a_wait_that_copies_before_its_collective_computes():
    """FSDP2's ``FSDP::all_gather`` span copies the shards in before gloo's span starts: that copying is compute,
    and only the part of the wait under the collective is the thread blocked. The step is then accounted whole:
    compute + exposed + other."""
    t = trace(event("ProfilerStep#1", 0, 1000, cat="user_annotation"), event("aten::mm", 0, 300),
              event("FSDP::all_gather (1)", 300, 500), event("fsdp::all_gather_copy_in", 310, 190),
              event("gloo:all_gather", 500, 300, tid=101, cat="user_annotation"), event("aten::relu", 850, 100))
    row = traces.step_split(traces.spans_of({0: t}))[0][0]
    assert row["compute"] == pytest.approx(590e-6)  # 0-300, the copy 310-500, 850-950
    assert row["exposed"] == pytest.approx(300e-6) and row["peer"] == 0
    assert row["other"] == pytest.approx(110e-6)  # 300-310, 800-850, 950-1000: between operators
    assert row["compute"] + row["exposed"] + row["other"] == pytest.approx(row["span"])


def test_waiting_for_a_late_peer_is_told_apart_from_moving_bytes():
    """Rank 1 computes 200 us longer, so rank 0's all-reduce span starts 200 us before rank 1's: that part of rank
    0's exposed time is waiting for its peer; rank 1, the late one, waits for nobody."""
    def rank_trace(compute_until):
        return trace(event("ProfilerStep#1", 0, 1000, cat="user_annotation"), event("aten::mm", 0, compute_until),
                     event("gloo:all_reduce", compute_until, 900 - compute_until, tid=101, cat="user_annotation"))
    split = traces.step_split(traces.spans_of({0: rank_trace(300), 1: rank_trace(500)}))
    early, late = split[0][0], split[1][0]
    assert early["exposed"] == pytest.approx(600e-6) and early["peer"] == pytest.approx(200e-6)
    assert late["exposed"] == pytest.approx(400e-6) and late["peer"] == 0
    assert traces.peer_waits(traces.spans_of({0: rank_trace(300)})) == {0: []}  # one rank: nobody to wait for
