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
* **steps**: the ``ProfilerStep#k`` spans the profiler puts around each profiled step of the main thread;
* **messages**: a point-to-point send is handed to the backend by ``c10d::send`` and arrives at the end of the
  receiver's ``gloo:recv`` (``nccl:recv``) span; neither span names the other rank, so :func:`transfer_costs` pairs
  them between two ranks only.

Per step and rank (:func:`step_split`): ``compute`` and ``comm`` are the lengths of the union of their spans inside
the step; ``exposed`` is the communication time during which no compute ran: what the step would lose if nothing
else were slow (the quantity DDP's bucketing and FSDP's prefetching shrink). Of that, ``peer`` is waiting for a
peer that started the collective later (load imbalance, not bytes: :func:`peer_waits`), and ``other`` is the rest
of the step (neither compute nor communication), so the three account for the whole step.

Pure (no torch). Example::

    traces = {r: json.load(open(f"trace_rank{r}.json")) for r in range(2)}
    split = step_split(spans_of(traces))       # {rank: [{"step", "compute", "comm", "exposed", "span"}, ...]}
    json.dump(merge(traces), open("trace.json", "w"))   # one lane per rank, for Perfetto or chrome://tracing
"""
from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence

COMM_PREFIXES = ("gloo:", "nccl:", "ncclDevKernel", "ncclKernel")
HANDOFF_PREFIXES = ("c10d::", "record_param_comms", "_c10d_functional", "c10d_functional")
WAIT_PREFIXES = ("_c10d_functional::wait_tensor", "c10d_functional::wait_tensor", "c10d::wait",
                 # FSDP2's main-thread spans around a collective it waits for (on gloo: the whole collective)
                 "FSDP::all_gather (", "FSDP::post_backward_reduce")
STEP_PREFIX = "ProfilerStep#"
SEND_OP = "c10d::send"  # the operator that hands a point-to-point message to the backend (gloo or NCCL)


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
    """The parts of ``first`` that ``second`` does not cover (any intervals: both are passed through
    :func:`union`). One pass over both, sorted: linear in their lengths."""
    cuts = union(second)
    out, j = [], 0
    for a, b in union(first):
        while j < len(cuts) and cuts[j][1] <= a:  # cuts that end before this interval starts: behind every later one
            j += 1
        cur, k = a, j
        while k < len(cuts) and cuts[k][0] < b:
            c, d = cuts[k]
            if c > cur:
                out.append((cur, c))
            cur = max(cur, d)
            if cur >= b:
                break
            k += 1
        if cur < b:
            out.append((cur, b))
    return out


def compute(rank_spans: Iterable[Mapping]) -> list[tuple[float, float]]:
    """When one rank computed: the union of its compute spans minus the time it waited while one of its
    collectives was in flight (both from :func:`spans`). A wait span can hold work of its own: FSDP2's
    ``FSDP::all_gather`` copies the shards in before its collective starts and out after it ends, and that copying
    is compute; only the part of a wait during which a collective ran is the thread blocked on it."""
    rank_spans = list(rank_spans)
    comm = union((s["t0"], s["t1"]) for s in rank_spans if s["kind"] == "comm")
    waits = union((s["t0"], s["t1"]) for s in rank_spans if s["kind"] == "wait")
    blocked = minus(waits, minus(waits, comm))  # waits while a collective was in flight
    return minus(union((s["t0"], s["t1"]) for s in rank_spans if s["kind"] == "compute"), blocked)


def by_rank(all_spans: Iterable[Mapping]) -> dict[int, list[Mapping]]:
    """The spans of each rank, ranks in order (each rank's spans in the order given)."""
    out: dict[int, list[Mapping]] = {}
    for s in all_spans:
        out.setdefault(s["rank"], []).append(s)
    return dict(sorted(out.items()))


def step_split(all_spans: Sequence[Mapping]) -> dict[int, list[dict]]:
    """Per rank, per profiled step (its ``ProfilerStep#`` span): ``compute``, ``comm``, ``exposed``, ``peer``,
    ``other`` and ``span``, in seconds, and the step's ``name``. ``peer`` is the part of ``exposed`` spent waiting
    for a late peer (:func:`peer_waits`): the collective had started on this rank and not yet on the last one.
    ``other`` is the rest of the step: neither compute nor communication (Python between operators, the
    profiler's own bookkeeping). So ``span = compute + exposed + other``, up to rounding."""
    peers = peer_waits(all_spans)
    out: dict[int, list[dict]] = {}
    for rank, mine in by_rank(all_spans).items():
        busy = compute(mine)
        comm = union((s["t0"], s["t1"]) for s in mine if s["kind"] == "comm")
        rows = []
        for step in sorted((s for s in mine if s["kind"] == "step"), key=lambda s: s["t0"]):
            lo, hi = step["t0"], step["t1"]
            c, m = clip(busy, lo, hi), clip(comm, lo, hi)
            exposed = minus(m, c)
            peer = minus(clip(peers.get(rank, []), lo, hi), c)
            rows.append(dict(step=step["name"], span=(hi - lo) / 1e6, compute=length(c) / 1e6, comm=length(m) / 1e6,
                             exposed=length(exposed) / 1e6, peer=length(peer) / 1e6,
                             other=length(minus([(lo, hi)], union(c + m))) / 1e6))
        out[rank] = rows
    return out


def peer_waits(all_spans: Sequence[Mapping]) -> dict[int, list[tuple[float, float]]]:
    """Per rank, when it waited inside a collective for a later peer: the k-th collective of a step (not a
    point-to-point message) is one call on every rank; none can finish before the last rank has started it, so
    on each rank the span from its own start to the last rank's start is waiting for that rank (a late peer: its
    compute ran longer), not moving bytes. Steps whose ranks hold different collectives give none."""
    calls: dict[int, list[list[dict]]] = {}
    for rank, mine in by_rank(all_spans).items():
        comm = sorted((s for s in mine if s["kind"] == "comm" and not s["name"].endswith((":send", ":recv"))),
                      key=lambda s: s["t0"])
        steps = sorted((s for s in mine if s["kind"] == "step"), key=lambda s: s["t0"])
        calls[rank] = [[c for c in comm if st["t0"] <= c["t0"] < st["t1"]] for st in steps]
    out: dict[int, list[tuple[float, float]]] = {rank: [] for rank in calls}
    if len(calls) < 2:
        return out
    for k in range(min(len(steps) for steps in calls.values())):
        step = {rank: steps[k] for rank, steps in calls.items()}
        if len({tuple(c["name"] for c in cs) for cs in step.values()}) > 1:
            continue
        for i in range(len(next(iter(step.values())))):
            last = max(cs[i]["t0"] for cs in step.values())
            for rank, cs in step.items():
                if cs[i]["t0"] < last:
                    out[rank].append((cs[i]["t0"], min(last, cs[i]["t1"])))
    return {rank: union(w) for rank, w in out.items()}


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
    per_rank = _calls_per_step(all_spans)
    return _fastest({rank: [[(c["t1"] - c["t0"]) / 1e6 for c in step] for step in steps]
                     for rank, steps in per_rank.items()}, block, "collectives")


def _fastest(per_rank: Mapping[int, Sequence[Sequence[float]]], block: int | None, what: str) -> list[float]:
    """{rank: [[the seconds of each call of its k-th step, in order], ...]} read as :func:`fastest_costs` reads."""
    if block is not None and block < 1:
        raise ValueError(f"block={block!r}: steps per block, 1 or more")
    steps = [step for rank_steps in per_rank.values() for step in rank_steps]
    if len({len(step) for step in steps}) > 1:
        raise ValueError(f"the profiled steps hold different numbers of {what}: {sorted({len(s) for s in steps})}")
    n = min((len(s) for s in per_rank.values()), default=0)
    size = n if block is None or block > n else block
    blocks = [[step for rank_steps in per_rank.values() for step in rank_steps[i:i + size]]
              for i in range(0, n - size + 1, size)] if size else []
    calls = len(steps[0]) if steps else 0
    return [sum(min(step[k] for step in b) for b in blocks) / len(blocks) for k in range(calls)]


def is_send(name: str) -> bool:
    """Where a point-to-point send was handed to the backend: the ``c10d::send`` operator. Not gloo's ``gloo:send``
    span, which gloo opens only after it has written the bytes (a large message's span starts after its receiver's
    ends)."""
    return name == SEND_OP


def is_recv(name: str) -> bool:
    """A point-to-point receive's span (``gloo:recv``; NCCL's ``nccl:recv``): from when it was posted to when the
    message had arrived."""
    return is_comm(name) and name.endswith(":recv")


def transfers(sends: Sequence[Mapping], recvs: Sequence[Mapping]) -> list[float]:
    """Each message's transfer time, seconds: the k-th send paired with the k-th receive (each in the order they
    started), from the later of the two starts to the receive's end. Neither span alone is the transfer: a
    receive posted early waits for its sender, and a send returns once its bytes are handed over. Unequal counts
    raise a ValueError (a message with no partner).

    >>> transfers([{"t0": 10.0}], [{"t0": 0.0, "t1": 40.0}])  # posted at 0, sent at 10, arrived at 40 (us)
    [3e-05]
    """
    if len(sends) != len(recvs):
        raise ValueError(f"{len(sends)} sends but {len(recvs)} receives: every message has one of each")
    return [(r["t1"] - max(s["t0"], r["t0"])) / 1e6 for s, r in zip(sorted(sends, key=lambda s: s["t0"]),
                                                                   sorted(recvs, key=lambda s: s["t0"]))]


def transfer_costs(all_spans: Sequence[Mapping], block: int | None = None) -> list[float]:
    """The cost of each message a rank receives in a step of a two-rank pipeline, read as :func:`fastest_costs`
    reads a collective: the k-th receive of every profiled step on both ranks (stage 0's gradients, stage 1's
    activations: the same shape) is one call repeated, and its transfer (:func:`transfers`, paired with the other
    rank's sends of the same step) at its fastest is its cost. gloo's send and receive spans do not name their
    peer, so only between two ranks is each receive's sender known: other rank counts raise a ValueError, as do
    steps that hold unequal numbers of messages."""
    ranks = by_rank(all_spans)
    if len(ranks) != 2:
        raise ValueError(f"{len(ranks)} ranks: send and receive spans name no peer, so messages are paired between "
                         "two ranks only")
    steps = {rank: sorted((s for s in mine if s["kind"] == "step"), key=lambda s: s["t0"])
             for rank, mine in ranks.items()}
    if len({len(s) for s in steps.values()}) > 1:
        raise ValueError(f"the ranks profiled different numbers of steps: { {r: len(s) for r, s in steps.items()} }")

    kinds = {test: {rank: [s for s in mine if test(s["name"])] for rank, mine in ranks.items()}
             for test in (is_send, is_recv)}  # filtered once: a trace holds millions of spans, a step a few messages

    def inside(rank, k, test):
        st = steps[rank][k]
        return [s for s in kinds[test][rank] if st["t0"] <= s["t0"] < st["t1"]]

    (a, b) = ranks
    per_rank = {a: [], b: []}
    for k in range(len(steps[a])):
        per_rank[a].append(transfers(inside(b, k, is_send), inside(a, k, is_recv)))
        per_rank[b].append(transfers(inside(a, k, is_send), inside(b, k, is_recv)))
    return _fastest(per_rank, block, "messages")


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


def _starting_inside(ordered: Sequence[Mapping], starts: Sequence[float], span: Mapping) -> list[Mapping]:
    """The spans of ``ordered`` (sorted by start, ``starts`` their starts) that start inside ``span``: a binary
    search, not a scan (a sweep's trace holds thousands of labels and of collectives)."""
    return list(ordered[bisect_left(starts, span["t0"]):bisect_left(starts, span["t1"])])


def labelled_costs(all_spans: Sequence[Mapping], prefix: str) -> dict[str, list[float]]:
    """The cost of each call inside a labelled span (``record_function`` names starting with ``prefix``, the same
    labels in the same order on every rank): the communication spans that start inside the n-th label of a rank
    belong to its n-th call; a call's cost is the shortest of the ranks' summed spans, seconds, as in
    :func:`fastest_costs`. Returns {label: [cost of each of its calls, in order]}."""
    per_label: dict[str, dict[int, list[float]]] = {}
    for rank, mine in by_rank(all_spans).items():
        comm = sorted((s for s in mine if s["kind"] == "comm"), key=lambda s: s["t0"])
        starts = [c["t0"] for c in comm]
        for label in sorted((s for s in mine if s["name"].startswith(prefix)), key=lambda s: s["t0"]):
            inside = sum(c["t1"] - c["t0"] for c in _starting_inside(comm, starts, label))
            per_label.setdefault(label["name"], {}).setdefault(rank, []).append(inside / 1e6)
    return {name: [min(call) for call in zip(*ranks.values())] for name, ranks in per_label.items()}


def labelled_transfers(all_spans: Sequence[Mapping], prefix: str) -> dict[str, list[float]]:
    """The cost of each one-way message inside a labelled span (labels as in :func:`labelled_costs`): the sends of
    every rank inside the n-th label paired with the receives of every rank inside theirs (:func:`transfers`),
    summed per call, seconds. Returns {label: [cost of each of its calls, in order]}."""
    occurrences: dict[str, list[list[dict]]] = {}
    for mine in by_rank(all_spans).values():
        comm = sorted((s for s in mine if is_send(s["name"]) or is_recv(s["name"])), key=lambda s: s["t0"])
        starts = [c["t0"] for c in comm]
        seen: dict[str, int] = {}
        for label in sorted((s for s in mine if s["name"].startswith(prefix)), key=lambda s: s["t0"]):
            n = seen[label["name"]] = seen.get(label["name"], -1) + 1
            calls = occurrences.setdefault(label["name"], [])
            while len(calls) <= n:
                calls.append([])
            calls[n] += _starting_inside(comm, starts, label)
    return {name: [sum(transfers([c for c in call if is_send(c["name"])], [c for c in call if is_recv(c["name"])]))
                   for call in calls] for name, calls in occurrences.items()}


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
