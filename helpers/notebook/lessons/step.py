"""Notebook 11 (inside a step): the settings, tables, timelines and claim lines its cells call.

``course/overlap.py`` trains one MLP six ways: DDP with small buckets, DDP with one bucket, no overlap (``no_sync``
and one all-reduce after the backward) (:data:`DDP_MODES`), and FSDP2 resharding after the forward or not, and with
explicit prefetch (:data:`FSDP_MODES`), each launched with ``--profile-steps``, so every rank leaves a torch.profiler
trace; ``course/gpt_tp.py`` adds tensor parallelism's all-reduces, and ``course/ds_cifar10.py`` DeepSpeed ZeRO-3
with and without prefetch (:data:`ZERO3_MODES`; overlap_comm: :func:`cpu_streams`). :mod:`helpers.calc.traces`
splits each profiled step of each rank into compute, communication and exposed communication (communication while
no compute ran); here those become a table, one timeline per mode, and the claims. The share of communication
*hidden* behind compute, ``1 - exposed / comm``, is what the three modes differ in by construction; the exposed
*time* is compared only where every rank has a core of its own, since ranks that take turns on a core wait for the
scheduler too (the cell says which it did).

Example (notebook cells)::

    cfg = lesson.settings(PROFILE, NPROC)
    runs = lesson.by_mode(launch.torchrun("course/overlap.py", nproc=cfg.nproc, args=cfg.args(*lesson.DDP_MODES)))
    lesson.show_table(runs)
    lesson.claim_overlap(runs, cfg)
"""
from __future__ import annotations

import json
import os
import statistics
from collections import Counter
from dataclasses import dataclass

from ...calc import traces as calc
from .. import traces
from ..checks import claim
from ..i18n import AUTO, Cell, Lines, _
from ..scripts import COURSE

SCRIPT = "course/overlap.py"
DDP_MODES = ("buckets", "one-bucket", "no-overlap")
FSDP_MODES = ("fsdp2", "fsdp2-keep", "fsdp2-prefetch")
MODES = DDP_MODES + FSDP_MODES
# DeepSpeed ZeRO-3 with its defaults and with prefetch off (notebook 03's ds_config at stage 3 otherwise)
ZERO3_MODES = {"zero3": {}, "no-prefetch": {"stage3_prefetch_bucket_size": 0}}  # overlap_comm: cpu_streams
DS_CONFIG = COURSE / "ds_config.json"
LAYERS = 8  # the script's MLP
SWEEP_OPS = ("all_reduce", "all_gather", "reduce_scatter", "send")  # what the runs call (comm_model.calls_of)
# No constant margin decides a claim here: each compares a mode with what the same run measured where the answer
# is known by construction (no overlap hides nothing; a collective waited for where it is issued hides nothing), or
# asks which of two structural outcomes a measurement is nearer to (:func:`nearer`).


@dataclass(frozen=True)
class Settings:
    profile: str
    nproc: int
    cores: int
    steps: int = 8
    profiled: int = 5   # the MLP's runs; the traces and the sweep are read in blocks of this many (comm_model)
    short: int = 15     # the runs whose steps are short (TP, the pipeline, DeepSpeed's CNN) profile more: 3 blocks
    width: int = 1024

    @property
    def own_cores(self) -> bool:
        """Every rank has a core of its own (else ranks take turns and their waits include the scheduler's)."""
        return self.nproc <= self.cores

    def args(self, *modes: str) -> list:
        """course/overlap.py training ``modes`` one after another in one launch (:func:`by_mode` reads each)."""
        for mode in modes or (None,):
            if mode not in MODES:
                raise ValueError(f"mode {mode!r}: one of {', '.join(MODES)}")
        return ["--mode", *modes, "--steps", self.steps, "--skip-steps", self.steps - self.profiled,
                "--profile-steps", self.profiled, "--width", self.width]

    def zero3_args(self) -> list:
        """course/ds_cifar10.py (notebook 03's script) at ZeRO stage 3 on generated images, :attr:`short` steps
        profiled, evaluated on 256 test images as :meth:`zero_args`."""
        return ["--stage", 3, "--steps", 5 + self.short, "--skip-steps", 5, "--profile-steps", self.short,
                "--dataset", "synthetic", "--train-size", 2000, "--test-size", 256]

    def zero_args(self, stage: int) -> list:
        """course/ds_cifar10.py at ZeRO ``stage`` on generated images, :attr:`short` steps profiled (256 test images:
        the chapter reads the trace, not the accuracy, and 10,000 took 3 s of every launch)."""
        return ["--stage", stage, "--steps", 5 + self.short, "--skip-steps", 5, "--profile-steps", self.short,
                "--dataset", "synthetic", "--train-size", 2000, "--test-size", 256]

    @property
    def pp_nproc(self) -> int:
        """The pipeline runs on two stages whatever NPROC (one process at NPROC=1): gloo's send and receive spans
        name no peer, and only between two ranks is each message's sender known."""
        return min(self.nproc, 2)

    def pp_args(self) -> list:
        """course/gpt_pp.py (notebook 10's script, its defaults: 1F1B, 4 micro-batches), :attr:`short` steps
        profiled."""
        return ["--steps", 3 + self.short, "--skip-steps", 3, "--profile-steps", self.short]

    def tp_args(self) -> list:
        """course/gpt_tp.py (notebook 09's script, its defaults), :attr:`short` steps profiled."""
        return ["--steps", 3 + self.short, "--skip-steps", 3, "--profile-steps", self.short]

    def sweep_args(self, again: bool = False) -> list:
        """course/collective_sweep.py, traced and read as the runs are: the four collectives the runs' steps call,
        two blocks of calls back to back; and three of them again up to 1 MiB, each call after 30 ms without
        communication (comm_model.fits prices the larger sizes as back to back: there the bytes dominate), in two
        blocks (with one, a noisy sweep read the penalty of idling at 1.12 against its own noise of 1.13, where
        twelve others read 1.21-1.65). ``again``: the calls back to back only, timed after the runs to measure how
        far the machine moved while they ran (comm_model.claim_agreement)."""
        args = ["--ops", *SWEEP_OPS, "--trace", "--factor", 2, "--iters", 2 * self.profiled]
        if again:
            return args
        return args + ["--gaps-ms", 30, "--gap-iters", 2 * self.profiled, "--gap-max-bytes", 2 ** 20, "--gap-ops",
                       "all_reduce", "all_gather", "reduce_scatter"]

    def __str__(self) -> str:
        return (f"profile={self.profile} nproc={self.nproc} ({self.cores} cores here) steps={self.steps}, the last "
                f"{self.profiled} profiled; MLP of 8 layers x {self.width}")


def resolve(profile: str, cores: int, nproc=None) -> Settings:
    """The parameters with their defaults filled in, or a ValueError that says what to change."""
    nproc = 2 if nproc is None else nproc
    if not isinstance(nproc, int) or not 1 <= nproc <= 4:
        raise ValueError(f"NPROC={nproc!r}: use 1, 2, 3 or 4 ranks (the TP run splits 12 heads; 2 shows the overlap "
                         "best on a 2-core machine)")
    return Settings(profile, nproc, cores, width=1024 if profile == "smoke" else 4096)


def settings(profile="auto", nproc=None) -> Settings:
    """:func:`resolve` with this machine's profile and cores; prints the result."""
    from .. import env

    cfg = resolve(env.profile(profile), len(os.sched_getaffinity(0)), nproc)
    print(cfg)
    if cfg.nproc == 1:
        print("NPROC=1: one rank has nobody to exchange gradients with; DDP skips the all-reduce, so the timelines "
              "show compute only and the overlap claims below have nothing to compare.")
    return cfg


# ---------------------------------------------------------------------------------------- 1. the numbers


def by_mode(run) -> dict:
    """One launch of course/overlap.py with several modes as one run per mode: the same outcome, read from the folder
    the mode wrote its metrics and traces into. Raises if a mode left nothing."""
    modes = [m for m in MODES if (run.run_dir / m).is_dir()]
    out = {m: run.part(m) for m in modes}
    empty = [m for m, r in out.items() if not r.result]
    if not modes or empty:
        raise ValueError(f"{run.run_dir}: no result from mode(s) {', '.join(empty) or 'any'}: launch "
                         "course/overlap.py with two or more --mode values and let it finish")
    return out


def rows(run) -> list[dict]:
    """Every profiled step of every rank of ``run``: ``span``, ``compute``, ``comm``, ``exposed`` (seconds) and
    ``hidden``, the share of the communication that ran while compute did (None where there was none)."""
    out = []
    for rank, steps in traces.split(run).items():
        for r in steps:
            hidden = 1 - r["exposed"] / r["comm"] if r["comm"] > 0 else None
            out.append(dict(r, rank=rank, hidden=hidden))
    return out


def summary(runs: dict) -> dict[str, dict]:
    """Per mode, the median over ranks and steps of each quantity and its spread (min, max)."""
    out = {}
    for mode, run in runs.items():
        rs = rows(run)
        out[mode] = {}
        for key in ("span", "compute", "comm", "exposed", "peer", "other", "hidden"):
            values = [r[key] for r in rs if r[key] is not None]
            out[mode][key] = (statistics.median(values), min(values), max(values)) if values else (None, None, None)
        out[mode]["buckets"] = len(run.result.get("ddp_buckets") or [])
    return out


def show(lines: Lines) -> None:
    """Show a table in the notebook as a :class:`~helpers.notebook.i18n.Lines` output (the Chinese edition renders
    its words in Chinese), or print it outside one."""
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:  # pragma: no cover - IPython comes with the course
        get_ipython = None
    if get_ipython is not None and get_ipython() is not None:
        display(lines)
    else:
        print(lines.render())


def table_lines(s: dict) -> Lines:
    """The table of :func:`summary` as :class:`~helpers.notebook.i18n.Lines`: milliseconds, percent for hidden."""
    keys = ("span", "compute", "comm", "exposed", "peer", "other")
    heads = (_("step ms"), _("compute ms"), _("comm ms"), _("exposed ms"), _("late peer"), _("other ms"))

    def cell(v, scale=1e3):
        med, lo, hi = v
        return "-" if med is None else f"{med * scale:.0f} ({lo * scale:.0f}-{hi * scale:.0f})"

    rows = [[Cell(_("mode"), AUTO), Cell(_("buckets"), 9, ">")] + [Cell(h, 15, ">") for h in heads]
            + [Cell(_("hidden %"), 13, ">")]]
    rows += [[Cell(mode, AUTO), Cell(str(q["buckets"]), 9, ">")] + [Cell(cell(q[k]), 15, ">") for k in keys]
             + [Cell(cell(q["hidden"], 100), 13, ">")] for mode, q in s.items()]
    notes = (_("each column: its median over ranks and profiled steps (min-max); in every step, step = compute + "
               "exposed + other"),
             _("exposed: communication no compute covered; late peer: the part of it spent waiting for a rank that "
               "started the collective later"),
             _("other: neither compute nor communication; hidden: % of the communication that compute covered"))
    return Lines(rows + [[Cell(n)] for n in notes])


def show_table(runs: dict) -> dict:
    """The table of :func:`summary` (:func:`table_lines`), shown: timings, not compared."""
    s = summary(runs)
    show(table_lines(s))
    return s


def plot_modes(runs: dict, step: int = -1):
    """One profiled step of every mode, the timeline of every rank (:func:`helpers.notebook.traces.plot_step`)."""
    import matplotlib.pyplot as plt

    ranks = len({s["rank"] for s in traces.spans(next(iter(runs.values())))})
    fig, axes = plt.subplots(len(runs), 1, squeeze=False, figsize=(11, len(runs) * (1.0 + 0.9 * ranks)), sharex=True)
    for ax, (mode, run) in zip(axes.flat, runs.items()):
        traces.plot_step(run, step=step, ax=ax)
        ax.set_title(f"{mode}: one step, compute and communication per rank (hatched: exposed)", fontsize=10)
        ax.label_outer()
    fig.tight_layout()
    return fig


def merged(runs: dict) -> dict[str, str]:
    """Write each run's merged trace (``trace.json``, a lane per rank) and return its path relative to the runs
    folder (no absolute path: committed outputs show it)."""
    from ... import launch

    root = launch.runs_root().resolve()
    out = {}
    for mode, run in runs.items():
        path = traces.write_merged(run).resolve()
        out[mode] = os.path.relpath(path, root.parent)
    return out


# ---------------------------------------------------------------------------------------- 2. the claims


def nearer(value: float, this: float, that: float) -> bool:
    """Is ``value`` nearer ``this`` than ``that``? A measurement decides between two outcomes the structure allows,
    with no margin tuned to one machine."""
    return abs(value - this) < abs(value - that)


def hidden_shares(run) -> list[float]:
    """The hidden share of every profiled step of every rank that communicated."""
    return [r["hidden"] for r in rows(run) if r["hidden"] is not None]


def claim_buckets(runs: dict, cfg: Settings) -> None:
    """How many buckets DDP made: one per layer with --bucket-mb 4 (a 1024 x 1024 layer is 4 MiB, so each layer
    fills a bucket by itself), one with a cap larger than the model; none used by no-overlap."""
    got = {mode: runs[mode].result.get("ddp_buckets") or [] for mode in DDP_MODES}
    layer = cfg.width * (cfg.width + 1) * 4  # weight and bias, fp32 bytes
    claim("DDP cut the buckets run's gradients into one bucket per layer (8), and the one-bucket run's into one",
          got["buckets"] == [layer] * 8 and got["one-bucket"] == [8 * layer],
          measured=f"{len(got['buckets'])} and {len(got['one-bucket'])} buckets")


def claim_overlap(runs: dict, cfg: Settings) -> None:
    """The hidden share of each mode against the same run's floors: no overlap hides nothing by construction, so
    what the trace reads as hidden there is the instrument's floor (span edges); one bucket starts only when the
    backward is over, so it reads like no overlap, not like the buckets; and the buckets hide more in every profiled
    step than the other two modes in any. Where every rank has a core, that bucketing leaves less exposed."""
    s = summary(runs)
    if cfg.nproc == 1:
        spans = [r["span"] for r in rows(runs["buckets"])]
        jitter = max(spans) - min(spans)
        comm = max(q["comm"][0] for q in s.values())
        claim("one rank communicates nothing worth hiding: its collectives take less time than its steps' own "
              "jitter (the slowest profiled step minus the fastest)", comm < jitter,
              measured=f"at most {1e3 * comm:.2f} ms a step, jitter {1e3 * jitter:.1f} ms")
        return
    shares = {mode: hidden_shares(runs[mode]) for mode in DDP_MODES}
    med = {mode: statistics.median(v) for mode, v in shares.items()}
    floor = max(shares["no-overlap"])
    claim("no overlap: nothing runs beside its all-reduce, so what the trace reads as hidden there is the "
          "instrument's floor: nearer none than what the buckets hide", nearer(med["no-overlap"], 0.0, med["buckets"]),
          measured=f"{100 * med['no-overlap']:.1f}% hidden, at most {100 * floor:.1f}% in a step")
    claim("one bucket: it can start only when the backward is over, so it hides about what no overlap does, not "
          "what the buckets do", nearer(med["one-bucket"], med["no-overlap"], med["buckets"]),
          measured=f"{100 * med['one-bucket']:.1f}% hidden")
    least, most = min(shares["buckets"]), max(shares["one-bucket"] + shares["no-overlap"])
    claim("buckets: each all-reduce starts while the backward goes on, so every profiled step hides more of it than "
          "one bucket or no overlap does in any step", least > most,
          measured=f"{100 * least:.0f}% at least vs {100 * most:.1f}% at most")
    exposed = {mode: s[mode]["exposed"][0] for mode in DDP_MODES}
    if cfg.own_cores:
        claim("with a core per rank, bucketing leaves less communication exposed than no overlap",
              exposed["buckets"] < exposed["no-overlap"],
              measured=f"{1e3 * exposed['buckets']:.0f} vs {1e3 * exposed['no-overlap']:.0f} ms per step")
    else:
        print(f"{cfg.nproc} ranks on {cfg.cores} cores take turns: a rank's exposed time includes waiting for a core, "
              "so it is not compared here (the table shows it).")


# ---------------------------------------------------------------------------------------- 3. FSDP2 and TP


def comm_names(run, kinds: tuple[str, ...] = ("comm",)) -> list[Counter]:
    """Per rank, how many spans of each name (of these ``kinds``) one profiled step holds (the median step's
    counts): the collectives by default, their main-thread waits too with ``kinds=("comm", "wait")``."""
    out = []
    for mine in calc.by_rank(traces.spans(run)).values():
        steps = [s for s in mine if s["kind"] == "step"]
        counts = [Counter(c["name"] for c in mine if c["kind"] in kinds and st["t0"] <= c["t0"] < st["t1"])
                  for st in steps]
        out.append(Counter({k: statistics.median_low([c[k] for c in counts]) for k in set().union(*counts)}))
    return out


def claim_fsdp(runs: dict, cfg: Settings) -> None:
    """What FSDP2 calls per step, counted in the traces: a gather per layer before its forward, another before its
    backward unless reshard_after_forward=False keeps it, and one gradient reduction per layer, which gloo runs as
    an all-reduce (pytorch/pytorch#149869); and on a CPU device, none of it hidden (no separate streams): its hidden
    share reads like the DDP no-overlap run's, not the buckets' (``runs`` holds those two DDP modes too)."""
    got = {mode: comm_names(runs[mode]) for mode in FSDP_MODES}
    if cfg.nproc == 1:
        claim("one rank: FSDP2 has no shard to gather and no gradient to reduce, so its steps hold no collective",
              all(not sum(c.values()) for counts in got.values() for c in counts))
        return
    gathers = {mode: {c.get("gloo:all_gather", 0) for c in counts} for mode, counts in got.items()}
    reduces = {mode: {c.get("gloo:all_reduce", 0) for c in counts} for mode, counts in got.items()}
    claim(f"resharding after the forward, every rank gathers each of the {LAYERS} layers twice a step (forward and "
          "backward), with explicit prefetch too", gathers["fsdp2"] == gathers["fsdp2-prefetch"] == {2 * LAYERS},
          measured=f"{sorted(gathers['fsdp2'])} and {sorted(gathers['fsdp2-prefetch'])} all-gathers")
    claim("reshard_after_forward=False keeps the gathered layers until the backward: one gather per layer",
          gathers["fsdp2-keep"] == {LAYERS}, measured=f"{sorted(gathers['fsdp2-keep'])} all-gathers")
    claim("each layer's gradient reduction runs on gloo as an all_reduce span (no reduce_scatter in the trace)",
          all(r == {LAYERS} for r in reduces.values()) and not any("gloo:reduce_scatter" in c for counts in
                                                                    got.values() for c in counts),
          measured=f"{sorted(reduces['fsdp2'])} all-reduces")
    hidden = {mode: max(hidden_shares(runs[mode])) for mode in FSDP_MODES}
    none, buckets = (statistics.median(hidden_shares(runs[m])) for m in ("no-overlap", "buckets"))
    claim("on a CPU, FSDP2's main thread waits for each collective where it issues it: in every step, compute hides "
          "about what it hides with no overlap, not what the buckets hide, prefetch or not",
          all(nearer(h, none, buckets) for h in hidden.values()),
          measured="at most " + ", ".join(f"{mode} {100 * h:.1f}%" for mode, h in hidden.items()))


def claim_zero3(run, cfg: Settings) -> None:
    """DeepSpeed ZeRO-3 in the trace: every profiled step of every rank gathers parameters, and its gradient
    reduction is gloo's all_reduce as FSDP2's is (no reduce_scatter span)."""
    counts = comm_names(run)
    if cfg.nproc == 1:
        print("NPROC=1: ZeRO-3 on one rank holds whole parameters; what it calls is a collective of one.")
        return
    claim("ZeRO-3 gathers parameters in every step on every rank, and reduces gradients with all_reduce spans (no "
          "reduce_scatter in the trace)", all(c.get("gloo:all_gather", 0) > 0 and c.get("gloo:all_reduce", 0) > 0
                                              and not any("reduce_scatter" in k for k in c) for c in counts),
          measured=f"per step {sorted({c.get('gloo:all_gather', 0) for c in counts})} all-gathers, "
                   f"{sorted({c.get('gloo:all_reduce', 0) for c in counts})} all-reduces")


def zero_config(stage: int, **zero: object) -> dict:
    """Notebook 03's ds_config (course/ds_config.json) at ZeRO ``stage``, with these ``zero_optimization``
    settings on top."""
    config = json.loads(DS_CONFIG.read_text())
    config["zero_optimization"] = {**config.get("zero_optimization", {}), "stage": stage, **zero}
    return config


def zero3_config(mode: str) -> dict:
    """:func:`zero_config` at stage 3 with ``mode``'s :data:`ZERO3_MODES` settings."""
    if mode not in ZERO3_MODES:
        raise ValueError(f"ZeRO-3 mode {mode!r}: one of {', '.join(ZERO3_MODES)}")
    return zero_config(3, **ZERO3_MODES[mode])


def zero3_defaults() -> str:
    """What DeepSpeed's own config model (DeepSpeedZeroConfig) sets at stage 3 for the two knobs."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    z = DeepSpeedZeroConfig(stage=3)
    return (f"DeepSpeed's defaults at stage 3 (DeepSpeedZeroConfig): overlap_comm={z.overlap_comm}, "
            f"stage3_prefetch_bucket_size={z.prefetch_bucket_size:,}")


def cpu_streams() -> dict:
    """What DeepSpeed's CPU accelerator (``deepspeed/accelerator/cpu_accelerator.py``) offers to run work beside the
    main thread: its ``Stream`` class and its ``current_stream()`` (None: it has none)."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    cpu = CPU_Accelerator()
    return {"Stream": cpu.Stream, "current_stream()": cpu.current_stream()}


def claim_zero3_knobs(zero3: dict, runs: dict, cfg: Settings) -> None:
    """ZeRO-3's knobs on a CPU (``zero3``: one run per :data:`ZERO3_MODES`; ``runs``: section 1's, whose no-overlap
    run is what hiding nothing looks like here). Prefetching gathers the next parameters while the current layer
    computes, on gloo's worker thread; without it, each gather is waited for where it is needed. overlap_comm
    moves the gradient reduction onto a second stream, and DeepSpeed's CPU accelerator has none
    (:func:`cpu_streams`): that is checked on DeepSpeed itself, not timed. (A run with it off, timed beside the
    defaults, read the same collectives and a hidden share nearer the default's, 13-23% against 19-28%, but once
    nearer no prefetch's 0%: the comparison was the machine's to decide.) Medians over the profiled steps: one
    default step of one regeneration hid 2%, its median 21%."""
    streams = cpu_streams()
    claim("overlap_comm has nothing to act on on a CPU: DeepSpeed's CPU accelerator has no stream to move the "
          "gradient reduction onto (its Stream is None and current_stream() returns None), so the reduction runs "
          "where it is issued, on or off", all(v is None for v in streams.values()),
          measured=", ".join(f"{k} {v!r}" for k, v in streams.items()))
    if cfg.nproc == 1:
        print("NPROC=1: ZeRO-3 on one rank gathers nothing from another rank; nothing to overlap or prefetch.")
        return
    median = {mode: statistics.median(hidden_shares(zero3[mode])) for mode in ZERO3_MODES}
    none = statistics.median(hidden_shares(runs["no-overlap"]))
    claim("without prefetch (stage3_prefetch_bucket_size=0) each gather is waited for where it is needed: compute "
          "hides about what it hides with no overlap (section 1), not what it hides with DeepSpeed's defaults",
          nearer(median["no-prefetch"], none, median["zero3"]),
          measured=f"median hidden {median['no-prefetch']:.1%} vs {none:.1%} and {median['zero3']:.1%}")


def claim_tp(run, cfg: Settings) -> None:
    """TP's all-reduces in the trace: 4 per layer per step (2 regions x forward and backward, notebook 09), each
    waited for on the main thread before the next operator can use its result."""
    layers = run.result["gpt"]["n_layer"]
    counts = comm_names(run, kinds=("comm", "wait"))
    per_step = [c.get("gloo:all_reduce", 0) for c in counts]
    waits = [c.get("_c10d_functional::wait_tensor", 0) for c in counts]
    want = 4 * layers if cfg.nproc > 1 else 0
    claim(f"TP all-reduces 4 times per layer per step: {want} on every rank for {layers} layers",
          set(per_step) == {want}, measured=f"{sorted(set(per_step))} per step")
    if cfg.nproc > 1:
        claim("and the main thread waits for each one (a wait_tensor span per all-reduce): the next operator needs "
              "its result", waits == per_step, measured=f"{sorted(set(waits))} waits per step")
        covered, by_mm = tp_cover(run)
        claim("so no matrix multiply runs while an all-reduce is in flight: the compute that the hidden column counts "
              "is DTensor's own dispatch around issuing and reading each result", covered > 0 and by_mm == 0,
              measured=f"{by_mm * 1e3:.1f} of {covered * 1e3:.1f} ms covered by a matmul, over all ranks and steps")


MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::baddbmm")


def tp_cover(run) -> tuple[float, float]:
    """Seconds of communication that compute covered, over every rank and profiled step of ``run``, and how much of
    that a matrix multiply covered (an operator in :data:`MATMULS`)."""
    covered = by_mm = 0.0
    for mine in calc.by_rank(traces.spans(run)).values():
        steps = calc.union((s["t0"], s["t1"]) for s in mine if s["kind"] == "step")
        comm = [iv for a, b in steps for iv in calc.clip(calc.union((s["t0"], s["t1"]) for s in mine
                                                                     if s["kind"] == "comm"), a, b)]
        hidden = calc.minus(comm, calc.minus(comm, calc.compute(mine)))
        mm = calc.union((s["t0"], s["t1"]) for s in mine if s["main"] and s["name"] in MATMULS)
        covered += calc.length(hidden) / 1e6
        by_mm += calc.length(calc.minus(hidden, calc.minus(hidden, mm))) / 1e6
    return covered, by_mm


def claim_pp(run, cfg: Settings) -> None:
    """A two-stage pipeline's point-to-point messages in the trace: per step, stage 0 sends each micro-batch's
    activations and receives its gradient, stage 1 the reverse; and every message's transfer is read from its
    send and its receive (:func:`helpers.calc.traces.transfer_costs`)."""
    micro = run.result["pp_microbatches"]
    if run.result["world_size"] == 1:
        print("NPROC=1: one process holds the whole GPT; no stage sends anything.")
        return
    counts = [(c.get("gloo:send", 0), c.get("gloo:recv", 0)) for c in comm_names(run)]
    claim(f"each of the 2 stages sends {micro} tensors and receives {micro} per step, one per micro-batch: "
          "activations forward, their gradients back", set(counts) == {(micro, micro)},
          measured=f"(sends, receives) per rank {counts}")
