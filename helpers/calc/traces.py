"""Profiler traces of a distributed step: one timeline for all ranks, and how much communication compute hid.

Every course script profiles a few steady-state steps with ``--profile-steps N`` (:class:`helpers.rank.harness.Meter`)
and writes ``trace_rank<R>.json`` per rank, torch.profiler's Chrome trace format: ``traceEvents``, each complete
event (``"ph": "X"``) a span with ``name``, ``cat``, ``pid`` (the rank's process), ``tid`` (its thread), ``ts`` and
``dur`` in microseconds. The ranks of one machine share one clock (their ``ts`` compare directly); across machines
``baseTimeNanoseconds`` offsets each file, and :func:`spans` adds it.

What is what, by name:

* **communication**: the collectives' own spans, ``gloo:all_reduce`` and the like on gloo's worker threads (CPU),
  ``nccl:...`` annotations and ``ncclDevKernel...``/``ncclKernel...`` kernels on a GPU stream (:func:`is_comm`);
  a span lasts from the collective's start on this rank to its end, so it includes waiting for the slowest peer;
* **compute**: the operators (``cat`` ``cpu_op``) of the rank's main thread, and GPU kernels that are not
  communication, minus the calls that only hand work to a collective (``c10d::...``, ``record_param_comms``);
* **steps**: the ``ProfilerStep#k`` spans the profiler puts around each profiled step of the main thread.

Per step and rank (:func:`step_split`): ``compute`` and ``comm`` are the lengths of the union of their spans inside
the step; ``exposed`` is the communication time during which no compute ran: what the step would lose if nothing
else were slow (the quantity DDP's bucketing and FSDP's prefetching shrink).

Pure (no torch). Example::

    traces = {r: json.load(open(f"trace_rank{r}.json")) for r in range(2)}
    split = step_split(spans_of(traces))       # {rank: [{"step", "compute", "comm", "exposed", "span"}, ...]}
    json.dump(merge(traces), open("trace.json", "w"))   # one lane per rank, for Perfetto or chrome://tracing
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

COMM_PREFIXES = ("gloo:", "nccl:", "ncclDevKernel", "ncclKernel")
HANDOFF_PREFIXES = ("c10d::", "record_param_comms", "_c10d_functional", "c10d_functional")
STEP_PREFIX = "ProfilerStep#"


def is_comm(name: str) -> bool:
    """A collective's own span (gloo's or NCCL's)."""
    return name.startswith(COMM_PREFIXES)


def spans(trace: Mapping, rank: int) -> list[dict]:
    """The complete events of one rank's trace as dicts: ``rank``, ``tid``, ``name``, ``cat``, ``t0``, ``t1``
    (microseconds on the shared clock), ``main`` (on the process's main thread), ``kind`` ("comm", "compute",
    "step" or "other")."""
    base = trace.get("baseTimeNanoseconds", 0) / 1000.0
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    out = []
    for e in events:
        name, cat, main = e.get("name", ""), e.get("cat", ""), e.get("tid") == e.get("pid")
        if is_comm(name):
            kind = "comm"
        elif name.startswith(STEP_PREFIX):
            kind = "step"
        elif (cat == "cpu_op" and main or cat == "kernel") and not name.startswith(HANDOFF_PREFIXES):
            kind = "compute"
        else:
            kind = "other"
        t0 = base + float(e["ts"])
        out.append(dict(rank=rank, tid=e.get("tid"), name=name, cat=cat, main=main, kind=kind, t0=t0,
                        t1=t0 + float(e["dur"])))
    return out


def spans_of(traces: Mapping[int, Mapping]) -> list[dict]:
    """:func:`spans` of every rank's trace."""
    return [s for rank, trace in sorted(traces.items()) for s in spans(trace, rank)]


def union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering exactly the given ones."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def length(intervals: Iterable[tuple[float, float]]) -> float:
    return sum(b - a for a, b in union(intervals))


def clip(intervals: Iterable[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]


def minus(first: Sequence[tuple[float, float]], second: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of ``first`` that ``second`` does not cover (both from :func:`union`)."""
    out = []
    for a, b in union(first):
        cur = a
        for c, d in union(second):
            if d <= cur or c >= b:
                continue
            if c > cur:
                out.append((cur, c))
            cur = max(cur, d)
            if cur >= b:
                break
        if cur < b:
            out.append((cur, b))
    return out


def step_split(all_spans: Sequence[Mapping]) -> dict[int, list[dict]]:
    """Per rank, per profiled step (its ``ProfilerStep#`` span): ``compute``, ``comm``, ``exposed`` and ``span``,
    in seconds, and the step's ``name``."""
    out: dict[int, list[dict]] = {}
    for rank in sorted({s["rank"] for s in all_spans}):
        mine = [s for s in all_spans if s["rank"] == rank]
        compute = union((s["t0"], s["t1"]) for s in mine if s["kind"] == "compute")
        comm = union((s["t0"], s["t1"]) for s in mine if s["kind"] == "comm")
        rows = []
        for step in sorted((s for s in mine if s["kind"] == "step"), key=lambda s: s["t0"]):
            lo, hi = step["t0"], step["t1"]
            c, m = clip(compute, lo, hi), clip(comm, lo, hi)
            rows.append(dict(step=step["name"], span=(hi - lo) / 1e6, compute=length(c) / 1e6, comm=length(m) / 1e6,
                             exposed=length(minus(m, c)) / 1e6))
        out[rank] = rows
    return out


def merge(traces: Mapping[int, Mapping]) -> dict:
    """One Chrome trace of all ranks: each rank's events under ``pid`` = its rank, named "rank R" (a lane per rank,
    a row per thread in Perfetto and chrome://tracing), on the shared clock from the earliest event at 0."""
    base = {r: t.get("baseTimeNanoseconds", 0) / 1000.0 for r, t in traces.items()}
    starts = [base[r] + float(e["ts"]) for r, t in traces.items() for e in t.get("traceEvents", []) if "ts" in e
              and e.get("ph") == "X"]
    zero = min(starts) if starts else 0.0
    events: list[dict] = []
    for rank, trace in sorted(traces.items()):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        for e in trace.get("traceEvents", []):
            if e.get("ph") == "M" and e.get("name") == "process_name":
                continue
            e = dict(e, pid=rank)
            if "ts" in e:
                e["ts"] = base[rank] + float(e["ts"]) - zero
            events.append(e)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"ranks": sorted(traces), "merged_by": "helpers.calc.traces.merge"}}
