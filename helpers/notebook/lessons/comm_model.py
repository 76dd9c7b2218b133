"""Notebook 11 (inside a step), model section: an alpha-beta model of each collective, fitted on this machine, and
its predictions for the steps of sections 1-3 against their traces.

``course/collective_sweep.py --trace`` times five collectives over message sizes inside torch.profiler, each call a
``sweep <op> <bytes>`` span. :func:`costs` reads each call's cost from the gloo spans as the training traces are
read (:func:`helpers.calc.traces.labelled_costs`: the shortest over the ranks, so nobody's lateness counts), and a
size's cost as a step's collective is read (the fastest of as many calls as there are profiled steps, averaged over
blocks), so the model and the measurements share one instrument and one statistic. :func:`fits` fits
``time = alpha + bytes / bandwidth`` per collective (:func:`helpers.calc.comm.fit_alpha_beta`) and keeps the
points for the per-range model (:func:`helpers.calc.comm.local_seconds`). :func:`calls_of` lists a traced run's
collectives from the course's byte formulas (DDP's buckets, FSDP2's per-layer gathers and reductions, TP's 4
all-reduces per layer, ZeRO-1/2's gradient, norm and partitions); :func:`residuals` sets the predictions beside
the trace (:func:`helpers.calc.traces.fastest_costs`).

Example (notebook cells)::

    sweep = launch.torchrun("course/collective_sweep.py", nproc=n, args=["--trace", "--factor", 2, "--iters", 20])
    model = model_lesson.show_fits(sweep, block=5)   # read as 5 profiled steps are
    table = model_lesson.show_residuals(model, runs | {"tp": tp} | zero12)
    model_lesson.claim_model(model, table, sweep)
"""
from __future__ import annotations

import json
import statistics
from collections import Counter

from ... import launch
from ...calc import comm
from ...calc import traces as calc
from .. import traces
from ..checks import claim
from .step import LAYERS, rows

LABEL = "sweep "
RING_RS = 0.5   # on a ring, a reduce-scatter of S bytes sends half an all-reduce's bytes (helpers/calc/tp.py)
LARGE = 2 ** 20  # from this message size up, bandwidth dominates the latency (alpha is about 0.2 ms here)


def costs(sweep, block: int | None = None) -> dict[str, dict[int, float]]:
    """{collective: {message bytes: its cost, seconds}} from the sweep's traces. A busy core, a late wake-up, a page
    fault only ever add time, so a size's cost is its fastest call (the median moved by 2x between two runs on this
    machine). With ``block``, read as a training trace is read (:func:`helpers.calc.traces.fastest_costs` takes
    each collective's fastest of ``block`` profiled steps): the fastest of every ``block`` consecutive calls,
    averaged over the blocks. The fastest of 20 calls is lower than the fastest of 5; compared with 5 profiled
    steps, it would make every step look slow."""
    if block is not None and block < 1:
        raise ValueError(f"block={block!r}: the number of profiled steps, 1 or more")
    out: dict[str, dict[int, float]] = {}
    for label, calls in calc.labelled_costs(traces.spans(sweep), LABEL).items():
        _, op, size = label.split()
        if block is None or len(calls) < block:
            out.setdefault(op, {})[int(size)] = min(calls)
        else:
            blocks = [calls[i:i + block] for i in range(0, len(calls) - block + 1, block)]
            out.setdefault(op, {})[int(size)] = statistics.mean(min(b) for b in blocks)
    return out


def fits(sweep, block: int | None = None) -> dict[str, dict]:
    """{collective: :func:`helpers.calc.comm.fit_alpha_beta` of its sweep} (and ``sizes``, ``seconds``), the costs
    read by :func:`costs` (``block``: the profiled steps the predictions will be compared with)."""
    out = {}
    for op, by_size in costs(sweep, block).items():
        sizes = sorted(by_size)
        out[op] = dict(comm.fit_alpha_beta(sizes, [by_size[s] for s in sizes]), sizes=sizes,
                       seconds=[by_size[s] for s in sizes])
    return out


def show_fits(sweep, block: int | None = None) -> dict[str, dict]:
    """The fitted latency and bandwidth per collective and the worst residual of the fit: timings, not compared."""
    model = fits(sweep, block)
    print(f"{'collective':<15} {'alpha (us)':>10} {'bandwidth (GB/s)':>17} {'worst residual':>15}")
    for op, f in model.items():
        worst = max(f["residuals"], key=abs)
        print(f"{op:<15} {f['alpha'] * 1e6:>10.0f} {f['bandwidth']:>17.2f} {worst:>+15.0%}")
    print("time = alpha + bytes / bandwidth, least squares on relative error; residual = measured / fitted - 1")
    return model


def spread(sweep, ops=("all_reduce", "reduce_scatter")) -> float:
    """The sweep's own noise: for each size of at least :data:`LARGE` bytes of these collectives, how much slower
    the second-fastest of its calls was than the fastest; the median of those (0.1: two best calls 10% apart)."""
    gaps = []
    for label, calls in calc.labelled_costs(traces.spans(sweep), LABEL).items():
        _, op, size = label.split()
        if op in ops and int(size) >= LARGE and len(calls) > 1:
            best, second = sorted(calls)[:2]
            gaps.append(second / best - 1)
    return statistics.median(gaps)


def rs_over_ar(model: dict) -> float:
    """The median over the sweep's sizes of at least :data:`LARGE` bytes of reduce_scatter's cost over
    all_reduce's at the same size (measured, not fitted: one noisy size cannot tilt a fitted slope)."""
    rs, ar = (dict(zip(model[op]["sizes"], model[op]["seconds"])) for op in ("reduce_scatter", "all_reduce"))
    return statistics.median(rs[s] / ar[s] for s in sorted(set(rs) & set(ar)) if s >= LARGE)


def calls_of(run) -> list[tuple[str, float]]:
    """A traced run's collectives per step per rank, from the course's byte formulas and what the run reports:
    ``(collective, message bytes)`` in the counters' convention (:func:`helpers.calc.comm.bytes_sent_per_rank`)."""
    r = run.result
    n = r["world_size"]
    if n == 1:
        return []  # one rank: DDP, FSDP2, TP and ZeRO call no collective
    if r.get("framework") == "deepspeed":
        return deepspeed_calls(run)
    if r.get("framework") == "tp":
        g = r["gpt"]
        calls = sum(sum(phase.values()) for phase in r["tp_comm_calls"].values())
        return [("all_reduce", r["global_batch"] // r["dp_degree"] * g["seq_len"] * g["d_model"] * 4)] * calls
    mode, layer_bytes = r["ddp_sync"], r["grad_mib"] * 2 ** 20 / LAYERS
    if mode == "no-overlap":
        return [("all_reduce", r["grad_mib"] * 2 ** 20)]
    if mode.startswith("fsdp2"):  # a gather before each forward, another before each backward unless kept
        gathers = LAYERS if mode == "fsdp2-keep" else 2 * LAYERS
        return [("all_gather", layer_bytes / n)] * gathers + [("reduce_scatter", layer_bytes)] * LAYERS
    return [("all_reduce", b) for b in r["ddp_buckets"]]


def deepspeed_calls(run) -> list[tuple[str, float]]:
    """DeepSpeed ZeRO-1 and ZeRO-2's collectives per step, fp32, read off a profiled run with record_shapes (these
    runs' CNN of P parameters, its reduce bucket larger than the model): one all-reduce of the whole gradient (P
    values: gloo has no reduce-scatter, so the gradient is reduced whole and each rank keeps its partition), one
    of the gradient norm (a single value) when the ds_config clips gradients, and one all-gather of the updated
    partitions (P / N values each). ZeRO-3 gathers parameters in groups it chooses as it runs, whose sizes the
    trace does not keep: it is not priced (a ValueError)."""
    r = run.result
    stage, n, params = r["zero_stage"], r["world_size"], r["params"]
    if stage not in (1, 2):
        raise ValueError(f"ZeRO-{stage} is not priced: only ZeRO-1 and ZeRO-2's collectives follow from the formulas")
    if r.get("dtype", "fp32") != "fp32":
        raise ValueError(f"priced in fp32 only, this run trained in {r['dtype']}")
    config_file = run.run_dir / launch.DS_CONFIG_FILE
    if not config_file.exists():
        raise ValueError(f"{run.run_dir}: no {launch.DS_CONFIG_FILE}; launch with the ds_config as a dict, which the "
                         "launcher keeps in the run directory")
    clipping = json.loads(config_file.read_text()).get("gradient_clipping", 0) or 0
    return ([("all_reduce", params * 4)] + [("all_reduce", 4)] * (clipping > 0) +
            [("all_gather", params * 4 / n)])


def residuals(model: dict, runs: dict) -> list[dict]:
    """Per run: its collectives priced by the fitted line (``line``) and by each size range's own line (``predicted``,
    :func:`helpers.calc.comm.local_seconds`), beside what the trace timed (``measured``: each collective's fastest
    instance over the profiled steps and ranks, :func:`helpers.calc.traces.fastest_costs`, the sweep's own reading
    of a size's calls), their ratio, how much of the communication compute hid, and the run's step-to-step jitter
    (slowest profiled step minus fastest)."""
    out = []
    for label, run in runs.items():
        calls = calls_of(run)
        line = comm.predict_calls(model, calls) if calls else 0.0
        predicted = comm.predict_calls(model, calls, local=True) if calls else 0.0
        measured = sum(calc.fastest_costs(traces.spans(run)))
        steps = rows(run)
        hidden = [r["hidden"] for r in steps if r["hidden"] is not None]
        spans = [r["span"] for r in steps]
        out.append(dict(config=label, calls=len(calls), line=line, predicted=predicted, measured=measured,
                        ratio=measured / predicted if predicted else None,
                        hidden=statistics.median(hidden) if hidden else None,
                        jitter=max(spans) - min(spans)))
    return out


def show_residuals(model: dict, runs: dict) -> list[dict]:
    """The residual table: timings, not compared."""
    table = residuals(model, runs)
    print(f"{'configuration':<15} {'calls':>5} {'one line ms':>12} {'per range ms':>13} {'traced ms':>10} "
          f"{'traced/range':>13} {'hidden':>7}")
    for t in table:
        ratio = "-" if t["ratio"] is None else f"{t['ratio']:.2f}"
        hidden = "-" if t["hidden"] is None else f"{t['hidden']:.0%}"
        print(f"{t['config']:<15} {t['calls']:>5} {t['line'] * 1e3:>12.1f} {t['predicted'] * 1e3:>13.1f} "
              f"{t['measured'] * 1e3:>10.1f} {ratio:>13} {hidden:>7}")
    print("per step and rank; each collective at its fastest over the profiled steps and ranks, as the sweep reads "
          "each size")
    return table


def claim_model(model: dict, table: list[dict], sweep) -> None:
    """The claims that hold on any machine of this kind: gloo's reduce-scatter is an all-reduce (the trace's span
    names) and costs more than the ring's half of one, by more than the sweep's own noise (:func:`spread`); with one
    rank, nothing to price. No claim compares the residual table's ratios: each configuration ran at its own moment,
    and on a 2-core machine shared with other work, one regeneration of the chapter timed the one-bucket and the
    no-overlap runs' single 32 MiB all-reduce after the backward at 45 and 100 ms: more than the effects the table
    could show."""
    names = Counter(s["name"] for s in traces.spans(sweep) if s["kind"] == "comm")
    claim("gloo runs reduce_scatter as an all_reduce: the sweep's trace holds no reduce_scatter span",
          not any("reduce_scatter" in n for n in names) and names["gloo:all_reduce"] > 0,
          measured=", ".join(f"{n} x{k}" for n, k in sorted(names.items()) if "barrier" not in n))
    ratio, noise = rs_over_ar(model), spread(sweep)
    claim(f"so a reduce-scatter of S bytes costs more than a ring's {RING_RS:g} x an all-reduce of S, by more than the "
          f"sweep's own noise (their median cost ratio from {LARGE // 2 ** 20} MiB up, against {RING_RS:g} x (1 + the "
          "gap between a size's two fastest calls))", ratio > RING_RS * (1 + noise),
          measured=f"{ratio:.2f} vs {RING_RS * (1 + noise):.2f}")
    if not any(t["ratio"] is not None for t in table):
        claim("one rank: the formulas predict no collective, and what the traces time in a step (collectives of one) "
              "is less than that run's own step-to-step jitter",
              all(t["calls"] == 0 and t["measured"] < t["jitter"] for t in table),
              measured=", ".join(f"{t['config']} {1e3 * t['measured']:.2f} vs {1e3 * t['jitter']:.1f} ms"
                                 for t in table))
