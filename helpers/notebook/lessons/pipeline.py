"""Notebook 10 (pipeline parallelism): the settings, tables, Gantt charts and claim lines the notebook's cells call.

course/gpt_pp.py cuts the course's GPT into ``NPROC`` balanced stages and runs torch's GPipe and 1F1B schedules on
them with ``MICROBATCHES`` micro-batches, each beside an fp64 twin; the one-process run (the whole GPT, no pipeline)
in fp32 and fp64 is the reference (:mod:`helpers.calc.parity`). Every rank reports the timeline of its forward and
backward actions and the activation bytes each stage held (:mod:`helpers.rank.pipeline`); the formulas are in
:mod:`helpers.calc.pipeline`.

The bubble, measured: per rank ``1 - busy / span`` of a step (busy: the summed durations of its actions; span: the
first action's start to the last action's end over all ranks), the mean over ranks, then the median over the
steps after the warm-up ones, with the spread; on the clock, and of each step replayed with its measured durations
and free communication (:func:`helpers.calc.pipeline.replay`), which is what the formula describes. It is claimed
against the formula only where the machine gives every rank a core of its own (``os.sched_getaffinity``): ranks
that share a core wait for it, and that wait shows as busy time or as idle time depending on where the scheduler
cuts in.

Section 7 runs course/gpt_3d.py (DP x PP x TP on 8 ranks); section 8 holds the configuration guide
(:mod:`helpers.calc.plan`) against the memory each of those ranks measured.

Example (notebook cells)::

    cfg = lesson.settings(PROFILE, NPROC, MICROBATCHES, STEPS)
    ...  # the launches, in the notebook
    lesson.claim_losses(runs)
    lesson.claim_bubbles(runs, cfg)
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from ...calc import parity, pipeline
from ...rank import metrics
from ..checks import claim
from ..i18n import _, say
from ..scripts import COURSE
# section 8 (choosing a layout) lives in .layout; the notebook calls its functions through this module
from .layout import (GB, GIB, GPU_BYTES, GPUS_PER_NODE, MEGATRON_175B, MODEL_TIE, SCENARIOS, axis_costs,  # noqa: F401
                     bandwidth_here, claim_axis_costs, claim_prediction, gpt_shape, predicted_3d, show_here,
                     show_proposals)
# sections 3 and 4 (timelines, the bubble) live in .schedules; likewise called through this module
from .schedules import (BUBBLE_TOLERANCE, COLORS, MORE, TIMED, action_costs, actions, bubbles,  # noqa: F401
                        by_step, claim_bubbles, claim_more_schedules, claim_order, median_step, more_bubbles,
                        planned, planned_orders, plot_gantt, show_more_schedules)
from .table import Lines, columns, line, show

N_LAYER, D_MODEL, SEQ_LEN, BATCH = 12, 128, 256, 8  # 12 blocks: equal stages on 1, 2, 3, 4 ranks
SCHEDULE_OF = {"GPipe": "gpipe", "1F1B": "1f1b", "Interleaved 1F1B": "interleaved1f1b", "ZBV zero bubble": "zbv"}


@dataclass(frozen=True)
class Settings:
    profile: str
    nproc: int         # pipeline stages = ranks
    microbatches: int
    steps: int
    skip_steps: int
    cores: int         # cores this process may run on (os.sched_getaffinity)

    def __str__(self) -> str:
        return (f"profile={self.profile} nproc={self.nproc} (stages) microbatches={self.microbatches} "
                f"steps={self.steps}, {N_LAYER} blocks ({N_LAYER // self.nproc} per stage), d_model={D_MODEL}, "
                f"batch {BATCH} sequences of {SEQ_LEN}; {self.cores} cores for the ranks")

    def args(self, *extra) -> list:
        return ["--steps", self.steps, "--skip-steps", self.skip_steps, "--n-layer", N_LAYER, "--d-model", D_MODEL,
                "--seq-len", SEQ_LEN, "--batch-size", BATCH, "--microbatches", self.microbatches, *extra]

    @property
    def solo(self) -> list:
        """The flags a one-process run adds: every core (the script's default, one thread, is for ranks that share
        them), so the reference curve does not take the longest."""
        return ["--threads", self.cores]

    @property
    def more_layers(self) -> int:
        """Blocks for the two-stages-per-rank runs: 12 where 2 x NPROC stages divide them, else the next multiple."""
        v = 2 * self.nproc
        return N_LAYER if N_LAYER % v == 0 else v * -(-N_LAYER // v)

    def more_args(self) -> list:
        """The flags of :data:`MORE`'s runs, both in one launch: this chapter's GPT, 2 x NPROC stages."""
        args = self.args("--schedule", *(SCHEDULE_OF[label] for label in MORE))
        args[args.index("--n-layer") + 1] = self.more_layers
        return args

    @property
    def measurable(self) -> bool:
        """Whether every rank has a core of its own, so a rank's idle time is the pipeline's, not the scheduler's."""
        return self.cores >= self.nproc


def resolve(profile: str, cores: int, nproc=None, microbatches=None, steps=None) -> Settings:
    """The parameters with their defaults filled in, or a ValueError that says what to change."""
    nproc = nproc or 2
    microbatches = microbatches or 4
    if nproc < 1 or N_LAYER % nproc:
        raise ValueError(f"NPROC={nproc}: the GPT's {N_LAYER} blocks must split into equal stages; use one of "
                         f"{', '.join(str(d) for d in range(1, 7) if N_LAYER % d == 0)}")
    if BATCH % microbatches or (nproc > 1 and microbatches < nproc):
        fits = [d for d in range(nproc, BATCH + 1) if BATCH % d == 0]
        raise ValueError(f"MICROBATCHES={microbatches}: it must divide the batch of {BATCH} and, for 1F1B, be at "
                         f"least NPROC={nproc}; use one of {', '.join(map(str, fits))}")
    steps = steps or (6 if profile == "smoke" else 30)
    return Settings(profile, nproc, microbatches, steps, skip_steps=min(3, steps // 2), cores=cores)


def settings(profile="auto", nproc=None, microbatches=None, steps=None) -> Settings:
    """:func:`resolve` with this machine's profile and cores; prints the result."""
    from .. import env

    cfg = resolve(env.profile(profile), len(os.sched_getaffinity(0)), nproc, microbatches, steps)
    print(cfg)
    if cfg.nproc == 1:
        print("NPROC=1: one stage is the whole GPT in one process (no schedule runs): its bubble is 0, the "
              "formula's (p - 1) / (m + p - 1) too, and there is no pipeline memory to compare.")
    return cfg


# ---------------------------------------------------------------------------------------- 1. which schedules run


def torch_schedules() -> list[str]:
    import torch.distributed.pipelining as pp

    return sorted(n for n in dir(pp) if n.startswith("Schedule"))


def show_feasibility() -> None:
    """The record of tests/test_pp_schedules.py (:data:`helpers.calc.pipeline.FEASIBILITY`), one line a schedule."""
    import torch

    table = [line(_("torch {version}, gloo, 2 and 4 ranks, loss against one process:",
                    version=torch.__version__.split("+")[0]))]
    for name, (cls, per_rank, place) in pipeline.SCHEDULES.items():
        rec = pipeline.FEASIBILITY[name]
        need = rec.get("min_microbatches")
        what = _("runs") if rec["status"] == "runs" else f"{rec['status']}: {rec['error']} ({rec['issue']})"
        row = _("{n} stage(s)/rank, {shape}: {what}", n=per_rank, what=what,
                shape=_("V") if place == "v" else _("looped"))
        if need:
            row = _("{row}; needs micro-batches >= stages (torch: \"{error}\")", row=row, error=need["error"])
        table.append(columns(((None, "<"), (31, "<")), " ", cls, row))
    show(Lines(table))
    recorded = {cls for cls, _, _ in pipeline.SCHEDULES.values()}
    claim("the record of tests/test_pp_schedules.py lists every schedule torch.distributed.pipelining offers, each "
          "as running on gloo",
          recorded == set(torch_schedules()) and all(r["status"] == "runs" for r in pipeline.FEASIBILITY.values()),
          measured=f"{len(recorded)} recorded, {len(torch_schedules())} in torch")


# ---------------------------------------------------------------------------------------- 2. the same losses


def losses(run) -> list[float]:
    """Rank 0's logged loss per step: the last stage's mean micro-batch loss, broadcast."""
    return [r["loss"] for r in metrics.steps(run.metrics, 0)]


def claim_losses(runs: dict) -> dict:
    """fp64 and fp32 parity of GPipe and 1F1B with one process (floor over every fp32/fp64 pair)."""
    curves = {label: losses(run) for label, run in runs.items()}
    pairs = [(curves["one process"], curves["one process fp64"])] + [(curves[l], curves[l + " fp64"]) for l in TIMED]
    floor = parity.twin_floor(*pairs)
    # fp64 against fp64 scales the fp32 floor by 2^-29, which holds while a step only carries its perturbation on;
    # once the loss has risen, a step amplifies each perturbation by its own direction, and the two precisions'
    # gaps stop keeping that ratio (a clean clone measured fp64 64x above it at the step the loss rose)
    ref = curves["one process fp64"]
    stable = next((i for i in range(1, len(ref)) if ref[i] > ref[i - 1]), len(ref))
    calm = parity.twin_floor(*[(a[:stable], b[:stable]) for a, b in pairs])
    fp64 = {l: parity.check(curves[l + " fp64"][:stable], ref[:stable], calm, bound=parity.fp64_bound(calm))
            for l in TIMED}
    claim(f"in fp64, GPipe and 1F1B give the one-process loss at every step before the loss first rose ({stable} "
          f"of {len(ref)}), within {parity.K} x those steps' fp32 floor x 2^-29", all(r["ok"] for r in fp64.values()),
          measured=", ".join(f"{l} {r['gap']:.1e} (bound {r['bound']:.1e})" for l, r in fp64.items()))
    fp32 = {l: parity.check(curves[l], curves["one process"], floor) for l in TIMED}
    claim(f"in fp32, GPipe and 1F1B give one process's loss at every step, within {parity.K} x the noise floor",
          all(r["ok"] for r in fp32.values()),
          measured=", ".join(f"{l} {r['gap']:.1e}" for l, r in fp32.items()) + f"; floor {floor:.1e}")
    claim_floor_growth(curves["one process"], curves["one process fp64"])
    return curves


def claim_floor_growth(fp32: list, fp64: list) -> None:
    """Why the floor is larger than notebook 09's: one process's fp32 - fp64 gap per step beside its loss, and the
    claim that where the gap grows more than 100-fold it does so no earlier than the first step whose loss rose."""
    gaps = [abs(a - b) for a, b in zip(fp32, fp64)]
    jump = next((i for i, g in enumerate(gaps) if g > 100 * max(gaps[0], 1e-12)), None)
    rise = next((i for i in range(1, len(fp64)) if fp64[i] > fp64[i - 1]), None)
    claim("the gap between fp32 and fp64 grows more than 100-fold only from the first step whose loss rose (an "
          "unstable step amplifies rounding), or not at all", jump is None or (rise is not None and jump >= rise),
          measured=", ".join(f"{g:.0e} (loss {l:.2f})" for g, l in zip(gaps, fp64)) + "; " + (
              (f"gap x{gaps[jump] / max(gaps[0], 1e-12):.0f} at step {jump + 1}, loss first rose at step "
               f"{rise + 1 if rise is not None else 'none'}") if jump is not None else "no 100-fold growth"))


def show_stages(run, cfg: Settings) -> None:
    """Each stage's blocks and parameters by the formula (:func:`helpers.calc.plan.stage_params`), and rank 0's
    own count against it."""
    from ...calc import plan

    g = run.result["gpt"]
    shape = gpt_shape(g)
    counts = [plan.stage_params(shape, cfg.nproc, s) for s in range(cfg.nproc)]
    table = []
    for s, (blocks, n) in enumerate(zip(pipeline.stage_layers(g["n_layer"], cfg.nproc), counts)):
        extra = {(True, False): _("embeddings"), (False, True): _("final LayerNorm + head"),
                 (True, True): _("embeddings, final LayerNorm + head")}.get((s == 0, s == cfg.nproc - 1))
        values = dict(s=s, blocks=f"{blocks[0]}-{blocks[-1]}", n=f"{n:,}")
        table.append(line(_("stage {s}: blocks {blocks} + {extra}: {n} parameters", extra=extra, **values)
                          if extra else _("stage {s}: blocks {blocks}: {n} parameters", **values)))
    show(Lines(table))
    claim("rank 0 holds exactly the formula's parameters of stage 0", run.result["params"] == counts[0],
          measured=f"{run.result['params']:,}")


def claim_loss_rank(run, cfg: Settings) -> None:
    res = run.result
    claim(f"the loss is computed on rank {cfg.nproc - 1} (the last stage) and rank 0 logs that value, broadcast",
          res["pp_loss_rank"] == cfg.nproc - 1 and all(2.0 < x < 5.0 for x in losses(run)),
          measured=f"rank {res['pp_loss_rank']}, first loss {losses(run)[0]:.3f}")


# ---------------------------------------------------------------------------------------- 5. memory


def saved_bytes(run) -> dict[int, int]:
    return {int(s): b for res in run.results_by_rank().values() for s, b in res.get("pp_saved_bytes", {}).items()}


def claim_memory(runs: dict, cfg: Settings) -> None:
    """Per stage: GPipe holds all m micro-batches' activations, 1F1B at most min(p - s, m)."""
    p, m = cfg.nproc, cfg.microbatches
    gpipe, f1b = saved_bytes(runs["GPipe"]), saved_bytes(runs["1F1B"])
    if p == 1:
        claim("one process: no schedule, no stage to compare (the memory claims need NPROC >= 2)", not gpipe)
        return
    spec = ((5, ">"), (10, ">"), (9, ">"), (11, ">"), (20, ">"))
    show(Lines([columns(spec, _("stage"), "GPipe MiB", "1F1B MiB", "1F1B/GPipe", _("bound min(p-s, m)/m"))]
               + [columns(spec, str(s), f"{gpipe[s] / 2**20:.2f}", f"{f1b[s] / 2**20:.2f}", f"{f1b[s] / gpipe[s]:.2f}",
                          f"{min(p - s, m) / m:.2f}") for s in range(p)]))
    per_mb = {s: gpipe[s] / m for s in range(p)}  # GPipe holds every micro-batch at once: m of them
    claim(f"1F1B's stage s holds at most min(p - s, m) micro-batches' activations (GPipe: all {m}), so never more "
          f"than p = {p}", all(f1b[s] <= min(p - s, m) * per_mb[s] * 1.001 for s in range(p)),
          measured=", ".join(f"stage {s} {f1b[s] / per_mb[s]:.2f}" for s in range(p)))
    claim("1F1B's peak activation memory, summed over the stages, is below GPipe's",
          sum(f1b.values()) < sum(gpipe.values()) or m == 1,
          measured=f"{sum(f1b.values()) / 2**20:.1f} vs {sum(gpipe.values()) / 2**20:.1f} MiB")


# ---------------------------------------------------------------------------------------- 7. DP x PP x TP

MESH_3D = (2, 2, 2)  # (dp, pp, tp) of course/gpt_3d.py's defaults: 8 ranks


def print_roles(run) -> None:
    """Each rank's coordinates on the (dp, pp, tp) mesh, as the ranks printed them."""
    for r in sorted(run.results_by_rank()):
        line = next((l for l in run.log(r).splitlines() if f"rank {r}: data shard" in l), f"rank {r}: (no line)")
        print(line[line.index(f"rank {r}:"):] if f"rank {r}:" in line else line)


def claim_3d(runs3: dict) -> None:
    """The 8-rank curve against one process reading the same global batches; every mesh coordinate once."""
    curves = {label: losses(run) for label, run in runs3.items()}
    floor = parity.twin_floor((curves["one process"], curves["one process fp64"]), (curves["3-D"], curves["3-D fp64"]))
    fp64 = parity.check(curves["3-D fp64"], curves["one process fp64"], floor, bound=parity.fp64_bound(floor))
    fp32 = parity.check(curves["3-D"], curves["one process"], floor)
    claim(f"dp x pp x tp = 2 x 2 x 2 on 8 ranks gives one process's loss at every step (fp64 within {parity.K} x "
          f"floor x 2^-29, fp32 within {parity.K} floors)", fp64["ok"] and fp32["ok"],
          measured=f"fp64 gap {fp64['gap']:.1e} (bound {fp64['bound']:.1e}), fp32 gap {fp32['gap']:.1e}, "
                   f"floor {floor:.1e}")
    roles = sorted((res["dp_rank"], res["pp_stages"][0], res["tp_rank"])
                   for res in runs3["3-D"].results_by_rank().values())
    want = [(d, p, t) for d in range(MESH_3D[0]) for p in range(MESH_3D[1]) for t in range(MESH_3D[2])]
    claim("each of the 8 ranks holds a different (data shard, stage, tensor shard): the mesh covers every "
          "combination once", roles == want)


# ---------------------------------------------------------------------------------------- 6. bad input


def claim_refusals() -> None:
    from ... import launch

    cases = [(4, ["--n-layer", "6"]), (2, ["--microbatches", "3"]), (4, ["--microbatches", "2"]),
             (2, ["--schedule", "dualpipev", "--microbatches", "2"])]
    found = []
    for n, args in cases:
        try:
            launch.LaunchSpec.check("torchrun", COURSE / "gpt_pp.py", n, args, machine=launch.Machine(gpus=0, cpus=8))
            found.append((f"{n} ranks, {' '.join(args)}", "accepted"))
        except launch.LaunchError as e:
            found.append((f"{n} ranks, {' '.join(args)}", str(e)))
    for given, message in found:
        say(f"{given:38s} -> {message}")
    claim("each bad input is refused before any rank starts, with the value to change",
          all(m != "accepted" and " use " in m for _, m in found))
