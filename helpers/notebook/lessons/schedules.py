"""Notebook 10, sections 3 and 4: the pipeline's timelines and its bubble. Every rank's forward and backward actions
(``pp_timeline``), the plan each schedule made of them (unit costs, free communication) beside what the clock
measured, the order each rank ran them in against the schedule's own list, and the bubble: planned, replayed from
the measured durations (:func:`helpers.calc.pipeline.replay`) and on the clock, for GPipe and 1F1B and for the
schedules with two stages per rank. :mod:`.pipeline` re-exports these names: the notebook calls them as
``lesson.claim_bubbles(runs, cfg)`` and the like.
"""
from __future__ import annotations

import re
import statistics
from typing import TYPE_CHECKING

from ...calc import pipeline
from ..checks import claim
from ..i18n import _
from .table import Lines, columns, line, show
from .table import label as plot_label

if TYPE_CHECKING:
    from .pipeline import Settings

TIMED = ("GPipe", "1F1B")
MORE = ("Interleaved 1F1B", "ZBV zero bubble")  # two stages per rank: looped, and in a V
BUBBLE_TOLERANCE = 0.05
COLORS = {"F": "tab:blue", "B": "tab:orange", "I": "tab:red", "W": "tab:green"}

# ---------------------------------------------------------------------------------------- 3. timelines


def actions(run) -> list[dict]:
    """Every rank's actions as dicts (rank, step, kind, stage, mb, t0, t1)."""
    return [dict(rank=r, step=a[0], kind=a[1], stage=a[2], mb=a[3], t0=a[4], t1=a[5])
            for r, res in run.results_by_rank().items() for a in res["pp_timeline"]]


def by_step(acts: list[dict]) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for a in acts:
        out.setdefault(a["step"], []).append(a)
    return dict(sorted(out.items()))


def planned(step_actions: list[dict], n_stages: int) -> list[dict]:
    """The plan of one step: the order each rank ran its actions in, laid out with unit costs (F 1, B 2) and free
    communication (:func:`helpers.calc.pipeline.simulate`)."""
    orders: dict[int, list] = {}
    for a in sorted(step_actions, key=lambda a: a["t0"]):
        orders.setdefault(a["rank"], []).append((a["kind"], a["stage"], a["mb"]))
    return pipeline.simulate(orders, n_stages)


def median_step(run, cfg: Settings) -> list[dict]:
    """The timed step whose span is the median one (after the warm-up steps)."""
    steps = list(by_step(actions(run)).values())[cfg.skip_steps:]
    spans = [max(a["t1"] for a in s) - min(a["t0"] for a in s) for s in steps]
    return steps[sorted(range(len(steps)), key=spans.__getitem__)[len(steps) // 2]]


def plot_gantt(runs: dict, cfg: Settings):
    """Planned (unit slots) above measured (milliseconds), GPipe and 1F1B side by side."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(TIMED), figsize=(11, 4.2), squeeze=False)
    for col, label in enumerate(TIMED):
        step = median_step(runs[label], cfg)
        for row, (acts, scale, unit) in enumerate(((planned(step, cfg.nproc), 1.0, _("slots (F = 1, B = 2)")),
                                                   (step, 1000.0, "ms"))):
            ax = axes[row][col]
            t_zero = min(a["t0"] for a in acts)
            for a in acts:
                ax.barh(a["rank"], (a["t1"] - a["t0"]) * scale, left=(a["t0"] - t_zero) * scale,
                        color=COLORS[a["kind"]], edgecolor="white")
                ax.text((a["t0"] - t_zero + (a["t1"] - a["t0"]) / 2) * scale, a["rank"], str(a["mb"]),
                        ha="center", va="center", fontsize=7, color="white")
            ax.set(yticks=range(cfg.nproc), yticklabels=[f"rank {r}" for r in range(cfg.nproc)],
                   xlabel=plot_label(unit), title=plot_label(_("{schedule}: planned", schedule=label) if row == 0
                                                             else _("{schedule}: measured", schedule=label)))
            ax.invert_yaxis()
    fig.tight_layout()
    return fig


def planned_orders(run) -> dict[int, list[tuple[str, int]]]:
    """The schedule's own action list per rank (``pipeline_order``, reported as ``pp_planned``): its compute
    actions as (kind, micro-batch), the communication and gradient-reduction entries left out."""
    out = {}
    for rank, acts in (run.result.get("pp_planned") or {}).items():
        parsed = [re.fullmatch(r"(\d+)([FBIW])(\d+)", a) for a in acts if a]
        out[int(rank)] = [(m.group(2), int(m.group(3))) for m in parsed if m]
    return out


def claim_order(runs: dict, cfg: Settings) -> None:
    """Each rank ran its forwards and backwards in the order of the schedule's own action list."""
    if cfg.nproc == 1:
        claim("one process: no schedule, so no plan to follow (the order claim needs NPROC >= 2)",
              not runs["1F1B"].result.get("pp_planned"))
        return
    same, relabelled = [], []
    for label in TIMED:
        plan, step = planned_orders(runs[label]), median_step(runs[label], cfg)
        for rank in range(cfg.nproc):
            ran = [(a["kind"], a["mb"]) for a in sorted(step, key=lambda a: a["t0"]) if a["rank"] == rank]
            same.append([k for k, _ in ran] == [k for k, _ in plan.get(rank, [])])
            if ran != plan.get(rank):
                relabelled.append(_("{schedule} rank {rank} ran {ran}; its list reads {listed}", schedule=label,
                                    rank=rank, ran=" ".join(f"{k}{i}" for k, i in ran),
                                    listed=" ".join(f"{k}{i}" for k, i in plan.get(rank, []))))
    claim("every rank ran its forwards and backwards in the order of the schedule's own action list "
          "(pipeline_order)", all(same) and len(same) == 2 * cfg.nproc,
          measured=f"{sum(same)} of {len(same)} rank orders")
    if relabelled:  # torch 2.14.1 numbers the last 1F1B stage's planned forwards 1..m (tests/test_pp.py)
        show(Lines([line("  ", _("micro-batch numbers differ: {what}", what=what)) for what in relabelled]))


# ---------------------------------------------------------------------------------------- 4. the bubble


def bubbles(run, cfg: Settings, replayed: bool = False) -> dict:
    """The steady-state bubble of a run: on the clock, or (``replayed``) of each step replayed with its measured
    durations and free communication (:func:`helpers.calc.pipeline.replay`)."""
    return pipeline.steady_bubble(list(by_step(actions(run)).values()), skip=cfg.skip_steps,
                                  n_stages=cfg.nproc if replayed else None)


def typical_bubble(run, cfg: Settings) -> float:
    """The bubble of each timed step replayed with every action given its (kind, stage)'s median duration
    (:func:`action_costs`), the median over those steps: the stages' measured balance without one slow action (a
    moment in which the rank lost its core) deciding a step."""
    costs = action_costs(run, cfg)
    steps = [[dict(a, t1=a["t0"] + costs[(a["kind"], a["stage"])]) for a in step]
             for step in list(by_step(actions(run)).values())[cfg.skip_steps:]]
    return pipeline.steady_bubble(steps, skip=0, n_stages=cfg.nproc)["median"]


def claim_bubbles(runs: dict, cfg: Settings) -> dict:
    """The planned bubble equals the formula; replayed with each stage's median durations it is within 0.05 of it, or
    within the spread of the steps' own replays if that is wider (the run's noise floor), where each rank has a core;
    on the clock the bubble is at least the replayed one."""
    p, m = cfg.nproc, cfg.microbatches
    formula = pipeline.bubble_fraction(p, m)
    plan = {l: statistics.fmean(pipeline.measured_bubble(planned(median_step(runs[l], cfg), p)).values())
            for l in TIMED}
    replayed = {l: bubbles(runs[l], cfg, replayed=True) for l in TIMED}
    typical = {l: typical_bubble(runs[l], cfg) for l in TIMED}
    clock = {l: bubbles(runs[l], cfg) for l in TIMED}
    claim(f"the plans of GPipe and 1F1B idle exactly (p - 1) / (m + p - 1) = {formula:.3f} of a step",
          all(abs(v - formula) < 1e-9 for v in plan.values()))
    band = {l: max(BUBBLE_TOLERANCE, b["max"] - b["min"]) for l, b in replayed.items()}
    close = all(abs(typical[l] - formula) <= band[l] for l in TIMED)
    claim(f"replayed with each stage's median durations, GPipe's and 1F1B's bubbles are within {BUBBLE_TOLERANCE} of "
          f"the formula (or the spread of the steps' own replays, if wider; claimed where each rank has a core of its "
          f"own, else shown only)", close or not cfg.measurable,
          measured=", ".join(f"{l} {typical[l]:.3f} (each step replayed: median {b['median']:.3f}, min {b['min']:.3f}, "
                             f"max {b['max']:.3f})" for l, b in replayed.items()) +
          f", {replayed[TIMED[0]]['steps']} steps, vs {formula:.3f}; {cfg.cores} cores for {p} ranks")
    claim("on the clock each bubble is at least its replay's (no action started before its inputs existed); the "
          "difference is what the replay leaves out: waits for messages, the loss, the schedule's own work",
          all(clock[l]["median"] >= replayed[l]["median"] for l in TIMED),
          measured=", ".join(f"{l} {clock[l]['median']:.3f} (+{clock[l]['median'] - replayed[l]['median']:.3f})"
                             for l in TIMED))
    return clock


def more_bubbles(more: dict, cfg: Settings) -> tuple[dict, dict]:
    """Each interleaved/zero-bubble run's plan bubble (the order each rank ran, unit costs F 1, B 2, I 1, W 1) and its
    replayed steps' bubbles (:func:`helpers.calc.pipeline.steady_bubble`: median, min, max)."""
    p = cfg.nproc
    plans, replays = {}, {}
    for label, run in more.items():
        steps = list(by_step(actions(run)).values())
        plans[label] = statistics.fmean(pipeline.measured_bubble(planned(steps[-1], 2 * p)).values())
        replays[label] = pipeline.steady_bubble(steps, skip=cfg.skip_steps, n_stages=2 * p)
    return plans, replays


def action_costs(run, cfg: Settings) -> dict[tuple[str, int], float]:
    """The median duration of each (kind, stage) over the timed steps and micro-batches, in seconds."""
    out: dict[tuple[str, int], list] = {}
    for step in list(by_step(actions(run)).values())[cfg.skip_steps:]:  # the timed steps, as median_step keeps them
        for a in step:
            out.setdefault((a["kind"], a["stage"]), []).append(a["t1"] - a["t0"])
    return {k: statistics.median(v) for k, v in sorted(out.items(), key=lambda kv: (kv[0][1], "FBIW".index(kv[0][0])))}


def show_more_schedules(more: dict, runs: dict, cfg: Settings) -> None:
    """The table of plan and replayed bubbles beside 1F1B's, then ZBV's measured cost of each action kind per stage
    against the plan's (timings: the cell is not compared)."""
    p, m = cfg.nproc, cfg.microbatches
    if p == 1:
        show(Lines([line(_("one process: no pipeline"))]))
        return
    plans, replays = more_bubbles(more, cfg)
    f1b = bubbles(runs["1F1B"], cfg, replayed=True)["median"]
    spec = ((18, "<"), (6, ">"), (9, ">"), (6, ">"), (6, ">"))
    table = [columns(spec, _("schedule"), _("plan"), _("replayed"), "min", "max") + line("   ", _(
        "({blocks} blocks in {stages} stages; 1F1B replayed {f1b}, formula {formula})", blocks=cfg.more_layers,
        stages=2 * p, f1b=f"{f1b:.3f}", formula=f"{pipeline.bubble_fraction(p, m):.3f}"))]
    for label in more:
        r = replays[label]
        table.append(columns(spec, label, f"{plans[label]:.3f}", f"{r['median']:.3f}", f"{r['min']:.3f}",
                             f"{r['max']:.3f}"))
    costs = action_costs(more[MORE[1]], cfg)
    f = statistics.median(v for (k, _kind), v in costs.items() if k == "F")
    table += [[], line(_("{schedule}, median ms of each action (its plan: F 1, I 1, W 1 unit; here 1 unit = the median "
                         "F, {f} ms):", schedule=MORE[1], f=f"{f * 1e3:.1f}"))]
    for stage in range(2 * p):
        table.append(line("  ", _("stage {s}: {costs}", s=stage, costs=", ".join(
            f"{k} {costs[(k, stage)] * 1e3:5.1f} ({costs[(k, stage)] / f:.2f})" for k in "FIW" if (k, stage) in costs))))
    show(Lines(table))


def claim_more_schedules(more: dict, runs: dict, cfg: Settings) -> None:
    """Interleaved 1F1B's replay below 1F1B's (its distance from its own plan, which the stages' unequal costs
    decide, shown); ZBV's plan below interleaving's, and the two measured facts that keep ZBV's replay above its plan (a first stage without input gradient, a
    weight gradient cheaper than the input gradient); ZBV's replayed bubble itself is shown, not claimed."""
    p, m = cfg.nproc, cfg.microbatches
    if p == 1:
        claim("one process: no pipeline, so no interleaving (these claims need NPROC >= 2)", not more)
        return
    f1b = bubbles(runs["1F1B"], cfg, replayed=True)["median"]
    formula = pipeline.bubble_fraction(p, 2 * m)  # (p - 1) / (2 m + p - 1): the interleaved bubble, v = 2
    plans, replays = more_bubbles(more, cfg)
    inter, zbv = MORE
    claim(f"interleaving's plan idles (p - 1) / (2m + p - 1) = {formula:.3f}, and ZBV's plan less "
          f"({plans[zbv]:.3f})", abs(plans[inter] - formula) < 1e-9 and plans[zbv] < plans[inter])
    r = replays[inter]
    # How near the replay comes to the plan's number depends on how equal the stages' costs are on this machine (one
    # make course here replayed 0.166 against a plan of 0.111, two others 0.111 and 0.103): shown, not claimed.
    claim("replayed, interleaved 1F1B idles less than 1F1B (claimed where each rank has a core of its own; else shown "
          "only)", not cfg.measurable or r["median"] < f1b,
          measured=f"{r['median']:.3f} (its steps {r['min']:.3f}-{r['max']:.3f}; plan {plans[inter]:.3f}); "
                   f"1F1B {f1b:.3f}")
    costs = action_costs(more[zbv], cfg)
    rest = range(1, 2 * p)
    claim("ZBV's first stage computes no input gradient (its input is token ids) and does its whole backward as W; "
          "on the other stages W costs less than I",
          costs[("I", 0)] < 0.5 * min(costs[("W", s)] for s in rest) and costs[("W", 0)] > max(costs[("W", s)] for s in rest)
          and all(costs[("W", s)] < costs[("I", s)] for s in rest),
          measured=f"stage 0: I {costs[('I', 0)] * 1e3:.1f} ms, W {costs[('W', 0)] * 1e3:.1f} ms; other stages: "
                   f"W/I {min(costs[('W', s)] / costs[('I', s)] for s in rest):.2f}-"
                   f"{max(costs[('W', s)] / costs[('I', s)] for s in rest):.2f}")
