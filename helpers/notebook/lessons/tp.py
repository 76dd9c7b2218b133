"""Notebook 09 (tensor and sequence parallelism): the settings, tables and claim lines the notebook's cells call.

course/gpt_tp.py splits every layer of the course's GPT over ``NPROC`` ranks (Megatron's column- and row-parallel
plan, :mod:`helpers.calc.tp`), with and without sequence parallelism, then on a 2 x 2 (dp, tp) mesh with FSDP2. Each
run has an fp64 twin; the one-process run in fp32 and fp64 is the reference. The noise floor is
:func:`helpers.calc.parity.twin_floor` over every fp32/fp64 pair, the fp64 runs must agree within
:func:`helpers.calc.parity.fp64_bound` and the fp32 runs within :data:`helpers.calc.parity.K` floors.

Example (notebook cells)::

    cfg = lesson.settings(PROFILE, NPROC, STEPS)
    ...  # the launches, in the notebook
    lesson.claim_losses(runs, cfg)
    lesson.claim_comms(runs, cfg)
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from ...calc import activations, parity, tp
from ...rank import metrics
from ..checks import claim
from ..i18n import _, say
from ..scripts import COURSE, script_diff
from .table import Lines, columns, line, show
from .table import label as plot_label

HEADS, D_MODEL, SEQ_LEN, N_LAYER = 12, 96, 48, 2  # course/gpt_tp.py's defaults: 12 heads split over 1, 2, 3, 4
TP_RUNS = ("TP", "TP+SP")
COLLECTIVE_NAMES = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather",
                    "reduce_scatter_tensor": "reduce_scatter"}


@dataclass(frozen=True)
class Settings:
    profile: str
    nproc: int        # the TP degree of the main runs (ranks = nproc)
    steps: int
    batch: int        # sequences per step: the global batch of every run
    skip_steps: int
    gpus: int = 0     # GPUs of this machine (0: CPU ranks, gloo)

    @property
    def backend(self) -> str:
        return "nccl" if self.gpus else "gloo"

    def env_for(self, ranks: int) -> dict:
        """Variables for a launch of ``ranks`` ranks: on a machine with fewer GPUs than that (but some), CPU ranks
        with gloo (``CUDA_VISIBLE_DEVICES=""``), so the 2 x 2 section runs anywhere; else none."""
        return {"CUDA_VISIBLE_DEVICES": ""} if 0 < self.gpus < ranks else {}

    def __str__(self) -> str:
        return (f"profile={self.profile} nproc={self.nproc} (TP degree) steps={self.steps} global_batch={self.batch} "
                f"sequences of {SEQ_LEN} characters, {N_LAYER} layers, {HEADS} heads, d_model={D_MODEL}")

    def args(self, *extra) -> list:
        """The flags every run of the notebook shares, then ``extra``."""
        return ["--steps", self.steps, "--skip-steps", self.skip_steps, "--n-layer", N_LAYER, *extra]


def resolve(profile: str, gpus: int, nproc=None, steps=None) -> Settings:
    """The parameters with their defaults filled in, or a ValueError that says what to change."""
    nproc = nproc or (gpus if gpus and HEADS % gpus == 0 else 2)
    if nproc < 1 or HEADS % nproc:
        raise ValueError(f"NPROC={nproc}: the GPT's {HEADS} heads must split evenly over the TP ranks; "
                         f"use one of {', '.join(str(d) for d in range(1, HEADS + 1) if HEADS % d == 0)}")
    steps = steps or (16 if profile == "smoke" else 40)
    return Settings(profile, nproc, steps, batch=8, skip_steps=min(5, steps // 2), gpus=gpus)


def settings(profile="auto", nproc=None, steps=None) -> Settings:
    """:func:`resolve` with this machine's profile and GPU count; prints the result (and what NPROC=1 means)."""
    from .. import env

    cfg = resolve(env.profile(profile), env.gpu_count(), nproc, steps)
    print(cfg)
    if cfg.nproc == 1:
        print("NPROC=1: tensor parallelism of degree 1 is one process holding whole layers: every claim below still "
              "runs, comparing the TP script with itself, and every collective count is 0.")
    return cfg


# ---------------------------------------------------------------------------------------- 1. the script


def claim_script_changes(old: str = "gpt_train.py", new: str = "gpt_tp.py") -> None:
    """Claim lines about the diff from the DDP script to the TP script."""
    added = [l[1:] for l in script_diff(old, new, context=0) if l.startswith("+")]
    after = (COURSE / new).read_text()
    claim("the TP script wraps nothing in DDP(...) and splits every block with parallelize_module on the 'tp' mesh",
          "DDP(" not in after and any("parallelize_module(block, mesh[\"tp\"]" in l for l in added))
    claim("its optimizer is built after parallelize_module and fully_shard",
          after.index("torch.optim.AdamW(") > max(after.index("parallelize_module(block"),
                                                  after.index("fully_shard(model")))


# ---------------------------------------------------------------------------------------- 2. the shards


def claim_shards(run, full: dict[str, list[int]], nproc: int) -> None:
    """Every rank's shape of every parameter against :func:`helpers.calc.tp.shard_shape` of the one-process shape
    (``full``); prints block 0's and the replicated tables' shapes, one column per rank."""
    by_rank = run.results_by_rank()
    ok = sorted(by_rank) == list(range(nproc)) and all(
        shape == list(tp.shard_shape(tuple(full[name]), tp.shard_dim(name), nproc))
        for r in by_rank.values() for name, shape in r["shard_shapes"].items())
    shown = [n for n in full if (n.startswith("blocks.0.") and not n.endswith("bias")) or n in ("tok_emb.weight",
                                                                                                 "head.weight")]
    spec = ((26, "<"),) + ((10, ">"),) * (1 + len(by_rank))
    table = [columns(spec, _("parameter"), _("whole"), *(f"rank {r}" for r in sorted(by_rank))) + line("  ", _("split"))]
    for name in shown:
        dim = tp.shard_dim(name)
        split = _("replicated") if dim is None else (_("dim 0 (column-parallel)") if dim == 0 else
                                                     _("dim 1 (row-parallel)"))
        table.append(columns(spec, name, str(tuple(full[name])),
                             *(str(tuple(by_rank[r]["shard_shapes"][name])) for r in sorted(by_rank)))
                     + line("  ", split))
    show(Lines(table))
    claim(f"on each of the {nproc} ranks, q/k/v and mlp.up hold 1/{nproc} of their rows, proj and mlp.down 1/{nproc} "
          f"of their columns, and the embeddings, LayerNorms and head are whole (every parameter, every rank)", ok)


# ---------------------------------------------------------------------------------------- 3. the same losses


def global_losses(run) -> list[float]:
    """The global batch's loss per step: the mean of the ranks' losses (equal batches; TP ranks report the same)."""
    by_step: dict[int, list[float]] = {}
    for r in metrics.steps(run.metrics):
        by_step.setdefault(r["step"], []).append(r["loss"])
    return [statistics.fmean(v) for _, v in sorted(by_step.items())]


def claim_same_losses(curves: dict[str, list[float]], labels: tuple[str, ...], what: str) -> dict:
    """Two claim lines: the fp64 runs of ``labels`` against one process's fp64 run, then the fp32 runs against one
    process's fp32 run; the floor over every fp32/fp64 pair (``label`` and ``label fp64``). Returns the checks."""
    pairs = [(curves["one process"], curves["one process fp64"])] + [(curves[l], curves[l + " fp64"]) for l in labels]
    floor = parity.twin_floor(*pairs)
    fp64 = {l: parity.check(curves[l + " fp64"], curves["one process fp64"], floor, bound=parity.fp64_bound(floor))
            for l in labels}
    claim(f"in fp64, {what} give the one-process fp64 loss at every step, within {parity.K} x the fp32 floor x 2^-29",
          all(r["ok"] for r in fp64.values()),
          measured=", ".join(f"{l} {r['gap']:.1e} (bound {r['bound']:.1e})" for l, r in fp64.items()))
    fp32 = {l: parity.check(curves[l], curves["one process"], floor) for l in labels}
    claim(f"in fp32, {what} give one process's loss at every one of the {len(curves['one process'])} steps, within "
          f"{parity.K} x the noise floor of fp32 rounding",
          all(r["ok"] for r in fp32.values()),
          measured=", ".join(f"{l} {r['gap']:.1e}" for l, r in fp32.items()) +
                   f"; floor {floor:.1e} (fp32 vs fp64 twins), bound {parity.K * floor:.1e}")
    return {**fp32, **{l + " fp64": r for l, r in fp64.items()}}


def claim_losses(runs: dict, cfg: Settings) -> dict:
    """:func:`claim_same_losses` for TP and TP+SP on ``cfg.nproc`` ranks; returns the curves, for the plot."""
    curves = {label: global_losses(run) for label, run in runs.items()}
    claim_same_losses(curves, TP_RUNS, f"TP and TP+SP on {cfg.nproc} ranks")
    return curves


def plot_losses(curves: dict, cfg: Settings):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    steps = range(1, len(curves["one process"]) + 1)
    ax.plot(steps, curves["one process"], color="grey", lw=3, alpha=0.5, label=plot_label(_("1 process")))
    for run, style in (("TP", "o"), ("TP+SP", "x"), ("FSDP2 x TP", "+")):
        if run in curves:
            ax.plot(steps, curves[run], style, ms=5, label=run)
    ax.set(xlabel=plot_label(_("optimizer step")), ylabel=plot_label(_("loss of the global batch (nats/char)")),
           title=plot_label(_("TP degree {n}: the same losses as one process", n=cfg.nproc)))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------- 4. communication


def measured_calls(run) -> dict[int, dict[str, dict[str, int]]]:
    """Per rank: ``{phase: {collective: calls}}`` CommDebugMode counted in one step, with the course's names."""
    return {rank: {phase: {COLLECTIVE_NAMES.get(op, op): n for op, n in ops.items()}
                   for phase, ops in r["tp_comm_calls"].items()} for rank, r in run.results_by_rank().items()}


def comm_table(runs: dict, cfg: Settings) -> list[tuple]:
    """(run, phase, collective, measured calls on rank 0, formula calls, elements per call) rows."""
    rows = []
    for label in TP_RUNS:
        sp = label == "TP+SP"
        want, got = tp.tp_collectives(N_LAYER, cfg.nproc, sp), measured_calls(runs[label])[0]
        elements = tp.activation_elements(cfg.batch, SEQ_LEN, D_MODEL)
        for phase in tp.PHASES:
            for op in sorted(set(want[phase]) | set(got[phase])):
                size = D_MODEL if phase == "grad_sync" else elements
                rows.append((label, phase, op, got[phase].get(op, 0), want[phase].get(op, 0), size))
    return rows


def claim_comms(runs: dict, cfg: Settings) -> None:
    """The table of counted collectives against the formula, and the claim that they are equal on every rank."""
    rows = comm_table(runs, cfg)
    spec = ((6, "<"), (9, "<"), (15, "<"), (7, ">"), (7, ">"), (14, ">"))
    table = [columns(spec, _("run"), _("phase"), _("collective"), _("counted"), _("formula"), _("elements/call"))]
    table += [columns(spec, label, phase, op, str(got), str(want), f"{size:,}")
              for label, phase, op, got, want, size in rows]
    if not rows:
        table.append(line(_("(no collective in any phase: one rank sends nothing)")))
    for label in TP_RUNS:
        layer = tp.per_layer(cfg.nproc, label == "TP+SP")
        adds = "; ".join(f"{phase} " + ", ".join(f"{calls} {op}" for op, calls in ops.items())
                         for phase, ops in layer.items() if ops)
        table.append(line(_("each layer adds ({label}): {adds}", label=label, adds=adds or _("nothing (one rank)"))))
    show(Lines(table))
    same = all(measured_calls(runs[l])[rank] == {p: {c: n for c, n in tp.tp_collectives(N_LAYER, cfg.nproc,
                                                                                        l == "TP+SP")[p].items()}
                                                 for p in tp.PHASES}
               for l in TP_RUNS for rank in measured_calls(runs[l]))
    claim(f"on every rank, CommDebugMode counts exactly the formula's collectives in forward, backward and the "
          f"gradient sync, for TP and TP+SP on {cfg.nproc} ranks ({N_LAYER} layers, embedding and head terms included)",
          same)


def activation_rows(runs: dict, cfg: Settings) -> list[dict]:
    """Per run (one process, TP, TP+SP): what one block saved for backward on one rank (every block on every rank
    must agree: ``spread`` is how far the others are from it), and the course's formula for it (torch's SP plan
    keeps the all-gathered inputs of q/k/v and up whole), with Megatron-LM's SP count beside it."""
    s, b, h, a = SEQ_LEN, cfg.batch, D_MODEL, HEADS
    rows = []
    for label, t, sp in (("one process", 1, False), ("TP", cfg.nproc, False), ("TP+SP", cfg.nproc, True)):
        got = [x for res in runs[label].results_by_rank().values() for x in res["tp_saved_bytes"]]
        rows.append(dict(run=label, ranks=t, measured=got[0], spread=max(abs(x - got[0]) for x in got),
                         formula=activations.layer_bytes(s, b, h, a, tp=t, sp=sp, gathered_whole=True),
                         megatron=activations.layer_bytes(s, b, h, a, tp=t, sp=sp), sbh=4 * s * b * h))
    return rows


def claim_activations(runs: dict, cfg: Settings) -> list[dict]:
    """The table of :func:`activation_rows`, in KiB and in units of s b h fp32 elements, and the claim that every
    block on every rank saved the formula's bytes, within 1% (the formula's small terms are exact here too)."""
    rows = activation_rows(runs, cfg)
    spec = ((12, "<"), (5, ">"), (13, ">"), (8, ">"), (12, ">"), (16, ">"))
    names = {"one process": _("one process")}
    table = [columns(spec, _("run"), _("ranks"), _("measured KiB"), _("= x sbh"), _("formula KiB"),
                     _("Megatron SP KiB"))]
    for r in rows:
        megatron = f"{r['megatron'] / 1024:.1f}" if r["run"] == "TP+SP" else "-"
        table.append(columns(spec, names.get(r["run"], r["run"]), str(r["ranks"]), f"{r['measured'] / 1024:.1f}",
                             f"{r['measured'] / r['sbh']:.2f}", f"{r['formula'] / 1024:.1f}", megatron))
    table.append(line(_("one block's saved activations on one rank ({dims}, fp32); sbh = s x b x h x 4 bytes",
                        dims=f"s={SEQ_LEN}, b={cfg.batch}, h={D_MODEL}, a={HEADS}")))
    show(Lines(table))
    ok = all(r["spread"] == 0 and abs(r["measured"] - r["formula"]) <= 0.01 * r["formula"] for r in rows)
    claim(f"every block on every rank saves the formula's bytes, within 1%: 16 sbh + the softmax in one process; "
          f"with TP over t = {cfg.nproc} ranks the LayerNorms' inputs and outputs whole (4 sbh) and the rest / t; with "
          "torch's SP plan the LayerNorms' inputs / t, their all-gathered outputs whole (2 sbh), the rest / t", ok,
          measured=", ".join(f"{r['run']} {r['measured'] / r['sbh']:.3f} vs {r['formula'] / r['sbh']:.3f} sbh"
                             for r in rows))
    return rows


def print_bytes(cfg: Settings, dtype_bytes: int = 4) -> None:
    """What the counted collectives send per step on a ring and on gloo (formula; the CPU cannot show NVLink)."""
    table = []
    for sp in (False, True):
        ring = tp.activation_bytes_per_step(N_LAYER, cfg.batch, SEQ_LEN, D_MODEL, cfg.nproc, sp, dtype_bytes)
        gloo = tp.gloo_bytes_per_step(N_LAYER, cfg.batch, SEQ_LEN, D_MODEL, cfg.nproc, sp, dtype_bytes)
        table.append(columns(((6, "<"),), "TP+SP" if sp else "TP",
                             _("layers' activations per rank per step: ring (NCCL) {ring} MiB, gloo {gloo} MiB",
                               ring=f"{ring / 2**20:6.2f}", gloo=f"{gloo / 2**20:6.2f}")))
    show(Lines(table))


# ---------------------------------------------------------------------------------------- 5. DETAIL, 2-D


def claim_detail(run, cfg: Settings, *, ranks: int | None = None, label: str = "course/gpt_tp.py") -> None:
    """The run launched with TORCH_DISTRIBUTED_DEBUG=DETAIL had the DETAIL level on (rank 0 logs
    ``dist.get_debug_level()``) and finished, every step reported. ``ranks``: its rank count (default: NPROC)."""
    detail = "debug=DETAIL" in run.log(0)
    backend = "gloo" if ranks and 0 < cfg.gpus < ranks else cfg.backend  # too few GPUs: CPU ranks (env_for)
    claim(f"with TORCH_DISTRIBUTED_DEBUG=DETAIL active, {label} on {ranks or cfg.nproc} {backend} ranks runs to "
          f"the end (all {cfg.steps} steps, exit code 0) on this torch",
          detail and run.returncode == 0 and len(global_losses(run)) == cfg.steps)


def print_roles(run) -> None:
    """Each rank of the 2-D run: its data shard (dp) and its tensor shard (tp)."""
    by_rank = run.results_by_rank()
    dp, tp_degree = by_rank[0]["dp_degree"], by_rank[0]["tp_degree"]
    table = []
    for rank, r in sorted(by_rank.items()):
        rows, q_heads, t = D_MODEL // tp_degree, HEADS // tp_degree, r["tp_rank"]
        table.append(line(_("rank {rank}: dp rank {dp_rank} -> sequences {dp_rank}::{dp} of each global batch; tp "
                            "rank {t} -> heads {heads}, q.weight rows {rows}, of which FSDP2 stores {stored} here",
                            rank=rank, dp_rank=r["dp_rank"], dp=dp, t=t,
                            heads=f"{t * q_heads}-{(t + 1) * q_heads - 1}", rows=f"{t * rows}-{(t + 1) * rows - 1}",
                            stored=r["shard_shapes"]["blocks.0.attn.q.weight"][0])))
    show(Lines(table))


def claim_2d(runs: dict, curves: dict) -> None:
    """The 2 x 2 run and its fp64 twin against one process (the same global batch)."""
    by_rank = runs["FSDP2 x TP"].results_by_rank()
    roles = sorted((r["dp_rank"], r["tp_rank"]) for r in by_rank.values())
    claim("the 4 ranks cover the 2 x 2 mesh once each: every (dp rank, tp rank) pair", roles ==
          [(d, t) for d in range(2) for t in range(2)])
    curves.update({label: global_losses(run) for label, run in runs.items()})
    claim_same_losses(curves, ("FSDP2 x TP",), "FSDP2 x TP on a 2 x 2 mesh (global batch = 2 x the per-rank batch)")


# ---------------------------------------------------------------------------------------- 6. refused


def refusals(nproc: int) -> list[tuple[str, str]]:
    """What the launcher says to bad TP input, without starting anything: (the input, the message)."""
    from ... import launch

    cases = [(4, ["--tp", "3"]), (4, ["--n-head", "6"]), (3, ["--sp", "--seq-len", "64"]), (2, ["--n-head", "9"])]
    out = []
    for n, args in cases:
        try:
            launch.LaunchSpec.check("torchrun", COURSE / "gpt_tp.py", n, args, machine=launch.Machine(gpus=0, cpus=8))
            out.append((f"{n} ranks, {' '.join(map(str, args))}", "accepted"))
        except launch.LaunchError as e:
            out.append((f"{n} ranks, {' '.join(map(str, args))}", str(e)))
    return out


def claim_refusals(nproc: int) -> None:
    found = refusals(nproc)
    for given, message in found:
        say(f"{given:28s} -> {message}")
    claim("each bad input is refused before any rank starts, with the value to change", all(
        m != "accepted" and " use " in m for _, m in found))
