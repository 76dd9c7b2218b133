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
* **wait**: a main-thread wait for a collective's result (``_c10d_functional::wait_tensor``: tensor parallelism's
  DTensors wait inside the operator that first reads the result, an ``aten::add`` say; FSDP2's ``FSDP::all_gather``
  and ``FSDP::post_backward_reduce``, inside the autograd functions of its hooks): :func:`compute` takes these out of
  the operators around them, since a thread that waits computes nothing;
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
WAIT_PREFIXES = ("_c10d_functional::wait_tensor", "c10d_functional::wait_tensor", "c10d::wait",
                 # FSDP2's main-thread spans around a collective it waits for (on gloo: the whole collective)
                 "FSDP::all_gather (", "FSDP::post_backward_reduce")
STEP_PREFIX = "ProfilerStep#"


def is_comm(name: str) -> bool:
    """A collective's own span (gloo's or NCCL's)."""
    return name.startswith(COMM_PREFIXES)


def spans(trace: Mapping, rank: int) -> list[dict]:
    """The complete events of one rank's trace as dicts: ``rank``, ``tid``, ``name``, ``cat``, ``t0``, ``t1``
    (microseconds on the shared clock), ``main`` (on the process's main thread), ``kind`` ("comm", "compute",
    "wait", "step" or "other")."""
    base = trace.get("baseTimeNanoseconds", 0) / 1000.0
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    out = []
    for e in events:
        name, cat, main = e.get("name", ""), e.get("cat", ""), e.get("tid") == e.get("pid")
        if is_comm(name):
            kind = "comm"
        elif name.startswith(STEP_PREFIX):
            kind = "step"
        elif main and name.startswith(WAIT_PREFIXES):
            kind = "wait"
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


def compute(rank_spans: Iterable[Mapping]) -> list[tuple[float, float]]:
    """When one rank computed: the union of its compute spans minus its waits (both from :func:`spans`)."""
    rank_spans = list(rank_spans)
    return minus(union((s["t0"], s["t1"]) for s in rank_spans if s["kind"] == "compute"),
                 union((s["t0"], s["t1"]) for s in rank_spans if s["kind"] == "wait"))


def by_rank(all_spans: Iterable[Mapping]) -> dict[int, list[Mapping]]:
    """The spans of each rank, ranks in order (each rank's spans in the order given)."""
    out: dict[int, list[Mapping]] = {}
    for s in all_spans:
        out.setdefault(s["rank"], []).append(s)
    return dict(sorted(out.items()))


def step_split(all_spans: Sequence[Mapping]) -> dict[int, list[dict]]:
    """Per rank, per profiled step (its ``ProfilerStep#`` span): ``compute``, ``comm``, ``exposed`` and ``span``,
    in seconds, and the step's ``name``."""
    out: dict[int, list[dict]] = {}
    for rank, mine in by_rank(all_spans).items():
        busy = compute(mine)
        comm = union((s["t0"], s["t1"]) for s in mine if s["kind"] == "comm")
        rows = []
        for step in sorted((s for s in mine if s["kind"] == "step"), key=lambda s: s["t0"]):
            lo, hi = step["t0"], step["t1"]
            c, m = clip(busy, lo, hi), clip(comm, lo, hi)
            rows.append(dict(step=step["name"], span=(hi - lo) / 1e6, compute=length(c) / 1e6, comm=length(m) / 1e6,
                             exposed=length(minus(m, c)) / 1e6))
        out[rank] = rows
    return out


def _calls_per_step(all_spans: Sequence[Mapping]) -> dict[int, list[list[dict]]]:
    """{rank: [[the communication spans that start inside its k-th profiled step, in order], ...]}, refusing ranks
    whose steps hold different numbers of collectives (a ValueError)."""
    per_rank: dict[int, list[list[dict]]] = {}
    for rank, mine in by_rank(all_spans).items():
        comm = sorted((s for s in mine if s["kind"] == "comm"), key=lambda s: s["t0"])
        steps = sorted((s for s in mine if s["kind"] == "step"), key=lambda s: s["t0"])
        per_rank[rank] = [[c for c in comm if st["t0"] <= c["t0"] < st["t1"]] for st in steps]
    counts = {rank: [len(step) for step in steps] for rank, steps in per_rank.items()}
    if len({tuple(c) for c in counts.values()}) > 1:
        raise ValueError(f"the ranks' profiled steps hold different numbers of collectives: {counts}")
    return per_rank


def fastest_costs(all_spans: Sequence[Mapping], block: int | None = None) -> list[float]:
    """The cost of each collective of a step, read as a sweep reads a size's calls: the k-th collective of every
    profiled step on every rank is the same call repeated, and its fastest instance (seconds) is its cost. A
    rank's lateness, a busy core or a late wake-up only ever add time. With ``block``, the fastest over every
    ``block`` consecutive steps (all ranks), averaged over those blocks (a last, shorter block left out). Steps
    that hold different numbers of collectives, on one rank or across ranks, raise a ValueError (there is no k-th
    call to compare)."""
    if block is not None and block < 1:
        raise ValueError(f"block={block!r}: steps per block, 1 or more")
    per_rank = _calls_per_step(all_spans)
    steps = [step for rank_steps in per_rank.values() for step in rank_steps]
    if len({len(step) for step in steps}) > 1:
        raise ValueError(f"the profiled steps hold different numbers of collectives: {sorted({len(s) for s in steps})}")
    n = min((len(s) for s in per_rank.values()), default=0)
    size = n if block is None or block > n else block
    blocks = [[step for rank_steps in per_rank.values() for step in rank_steps[i:i + size]]
              for i in range(0, n - size + 1, size)] if size else []
    calls = len(steps[0]) if steps else 0
    return [sum(min(step[k]["t1"] - step[k]["t0"] for step in b) for b in blocks) / len(blocks) / 1e6
            for k in range(calls)]


def idle_before(all_spans: Sequence[Mapping]) -> list[float]:
    """How long each collective of the profiled steps followed its rank's previous one (ms: from the end of the
    latest communication span that ended before it started, on the same rank, to its start); a rank's first
    collective, with none before it, is left out."""
    out = []
    for rank, steps in _calls_per_step(all_spans).items():
        ends = sorted(s["t1"] for s in all_spans if s["rank"] == rank and s["kind"] == "comm")
        for call in (c for step in steps for c in step):
            before = [t for t in ends if t <= call["t0"]]
            if before:
                out.append((call["t0"] - before[-1]) / 1e3)
    return out


def labelled_costs(all_spans: Sequence[Mapping], prefix: str) -> dict[str, list[float]]:
    """The cost of each call inside a labelled span (``record_function`` names starting with ``prefix``, the same
    labels in the same order on every rank): the communication spans that start inside the n-th label of a rank
    belong to its n-th call; a call's cost is the shortest of the ranks' summed spans, seconds, as in
    :func:`fastest_costs`. Returns {label: [cost of each of its calls, in order]}."""
    per_label: dict[str, dict[int, list[float]]] = {}
    for rank, mine in by_rank(all_spans).items():
        comm = sorted((s for s in mine if s["kind"] == "comm"), key=lambda s: s["t0"])
        for label in sorted((s for s in mine if s["name"].startswith(prefix)), key=lambda s: s["t0"]):
            inside = sum(c["t1"] - c["t0"] for c in comm if label["t0"] <= c["t0"] < label["t1"])
            per_label.setdefault(label["name"], {}).setdefault(rank, []).append(inside / 1e6)
    return {name: [min(call) for call in zip(*ranks.values())] for name, ranks in per_label.items()}


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
