"""Notebook 04 (DDP vs DeepSpeed, measured): the launches' flags, the table, the plot and the claim lines.

One launch per configuration (DDP, ZeRO-1, ZeRO-2, ZeRO-3, ZeRO-3 + offload; the full profile adds ZeRO-0 and
ZeRO-2 + offload) of ``course/ddp_tuning.py`` or ``course/ds_tuning.py`` on the same model, data, global batch, seed
and steps. Each launch is counted (collectives, model-state bytes, checkpoint) and, on a CPU, also timed: its steps
after the warm-up are cut into ``windows`` equal windows (:func:`helpers.calc.throughput.window_samples_per_s`),
and a configuration's speed is their median with the min-max spread. On GPUs the counted runs' timings are biased
(DeepSpeed's comms_logger synchronises the device after every collective, which undoes the overlap of communication
with compute), so each timed configuration gets one more launch without counters; on a CPU that synchronisation
does nothing (DeepSpeed's CPU accelerator's ``synchronize`` returns at once, and a gloo collective has finished
when its call returns), so the counted launch is timed as it is.

What holds at every value the parameters cell offers (1-4 ranks, either profile), each a claim line:

* the engine takes over the DDP script's wrapper, optimizer, scheduler, clipping, autocast and accumulation;
* every run gives DDP's loss at every step within :data:`helpers.calc.parity.K` noise floors, the floor being the
  largest spread among the *other* runs (leave one out, :func:`helpers.calc.parity.spread_floor`);
* model states per rank match the ZeRO formula with DeepSpeed's K (ZeRO-2: with the whole gradients of the layers
  a rank's partition overlaps), checkpoint bytes per parameter are 12 or 16 by what each engine saves;
* bytes sent per optimizer step are 1.5x, (A + 0.5)x and Ax DDP's for ZeRO-1, ZeRO-2 and ZeRO-3 with A micro
  batches per step;
* no ZeRO stage's median is above DDP's by more than the widest window spread measured in the run, and ZeRO-3's is
  below DDP's (the spread is measured inside each launch: a machine whose load changes between launches, e.g. another
  job starting, is not covered);
* on a CPU the ZeRO-3 runs have the highest peak RSS; with two or more ranks ZeRO-3 holds the fewest model states,
  with one it saves nothing (as much as the other stages, more than DDP).

Example (notebook cells)::

    plan = comparison.Plan.resolve("smoke", 2)
    runs = {label: launch.torchrun(script, nproc=2, args=args) for label, script, args in plan.launches()}
    rows = comparison.table(runs, {}, plan)
    comparison.claim_same_math(runs, rows, plan)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from ...calc import memory, parity
from ...calc.throughput import median_spread, window_samples_per_s
from ..checks import claim

# what deepspeed.initialize and engine.backward/step take over: each is written in the DDP script, none in the DS one
TAKEN_OVER = {"the DDP wrapper": "DDP(", "accumulation without all-reduce": "no_sync()",
              "mixed precision": "torch.autocast", "clipping": "clip_grad_norm_", "the LR scheduler": "LambdaLR",
              "the optimizer": "torch.optim.AdamW", "its step": "optimizer.step()", "zero_grad": "zero_grad",
              "backward": "loss.backward()"}
# checkpoint bytes per parameter in fp32: DDP weights + Adam's m, v (12); ZeRO-1/2 also the fp32 master copy (16);
# ZeRO-3 the master copy and the moments, not the module's placeholders (12)
CHECKPOINT_BYTES = {0: 12, 1: 16, 2: 16, 3: 12}
# the configurations both profiles run: the claims name these (the full profile's ZeRO-0 and ZeRO-2 + offload are shown)
CLAIMED = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "ZeRO-3 + offload")


@dataclass(frozen=True)
class Config:
    label: str
    stage: int | None  # None: DDP
    offload: str | None = None

    @property
    def timed(self) -> bool:
        return self.offload is None  # offload on a CPU moves nothing; on GPUs its cost is PCIe and the CPU optimizer

    @property
    def slug(self) -> str:
        return "ddp" if self.stage is None else f"zero{self.stage}{self.offload or ''}"


@dataclass(frozen=True)
class Plan:
    """What the notebook runs: every value resolved from the parameters cell."""
    profile: str
    nproc: int
    params: int
    skip: int  # warm-up steps left out of the timing
    window: int  # steps per timed window
    windows: int
    micro_batch: int
    accumulation: int
    gpu: bool = False
    ckpt_root: Path = Path("runs/04_checkpoints")
    configs: tuple = field(default=())

    @classmethod
    def resolve(cls, profile: str, nproc: int, *, params=None, repeats: int = 3, skip=None, window=None,
                micro_batch: int = 8, accumulation: int = 2, gpu: bool = False, ckpt_root=None) -> "Plan":
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 3:
            raise ValueError("REPEATS: timed windows per launch, at least 3 (a median and a spread)")
        if isinstance(accumulation, bool) or not isinstance(accumulation, int) or accumulation < 1:
            raise ValueError("ACCUMULATION: micro batches per optimizer step, 1 or more")
        smoke = profile == "smoke"
        configs = [Config("DDP", None), Config("ZeRO-1", 1), Config("ZeRO-2", 2), Config("ZeRO-3", 3),
                   Config("ZeRO-3 + offload", 3, "both")]
        if not smoke:
            configs[1:1] = [Config("ZeRO-0", 0)]
            configs.insert(4, Config("ZeRO-2 + offload", 2, "optimizer"))
        return cls(profile, nproc, params or (20_000_000 if smoke else 300_000_000), skip or (2 if smoke else 5),
                   window or (3 if smoke else 10), repeats, micro_batch, accumulation, gpu,
                   Path(ckpt_root or cls.ckpt_root), tuple(configs))

    @property
    def steps(self) -> int:
        return self.skip + self.windows * self.window

    def steps_of(self, label: str) -> int:
        """Steps of a configuration's launch: all of them where it is timed; an untimed (offload) row runs only what
        its counters need (the model states are read in step 2, collectives counted from step 2 on)."""
        config = next(c for c in self.configs if c.label == label)
        return self.steps if config.timed else min(self.steps, max(3, self.skip + 1))

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.accumulation * self.nproc

    def args(self, config: Config, *, counted: bool) -> tuple[str, list]:
        """The script and flags of one launch (counted: collectives counted, a checkpoint written)."""
        steps = self.steps_of(config.label)
        args = ["--model", "memory", "--params", self.params, "--steps", steps, "--skip-steps", self.skip,
                "--batch-size", self.micro_batch, "--accumulation", self.accumulation, "--dataset", "synthetic",
                "--train-size", self.steps * self.global_batch * 2]  # the same data set (and order) for every run
        if counted:
            args += ["--save-dir", self.ckpt_root / config.slug]
        if config.stage is None:
            return "course/ddp_tuning.py", args + ([] if counted else ["--no-count-comms"])
        if not self.gpu:  # 5e6-element buckets (19 MiB in fp32, near DDP's 25 MiB); DeepSpeed's defaults are GPU-sized
            args += ["--bucket-size", 5_000_000]
        args += ["--stage", config.stage] + (["--count-comms"] if counted else [])
        return "course/ds_tuning.py", args + (["--offload", config.offload] if config.offload else [])

    def launches(self, *, counted: bool = True) -> list[tuple[str, str, list]]:
        """``(label, script, args)`` per launch. ``counted=False``: the extra timing launches, GPUs only."""
        if counted:
            return [(c.label, *self.args(c, counted=True)) for c in self.configs]
        if not self.gpu:
            return []  # on a CPU the counted launches are timed as they are (module docstring)
        return [(c.label, *self.args(c, counted=False)) for c in self.configs if c.timed]

    def run_name(self, label: str, *, timed: bool = False) -> str:
        """The run directory's name under ``runs/``: ``04_zero3both``, ``04_timed_ddp``."""
        slug = next(c.slug for c in self.configs if c.label == label)
        return f"04_{'timed_' if timed else ''}{slug}"

    def stage(self, label: str) -> int:
        return next(0 if c.stage is None else c.stage for c in self.configs if c.label == label)

    def __str__(self) -> str:
        return (f"profile {self.profile}: {self.nproc} ranks, wide MLP of ~{self.params:,} parameters, fp32, "
                f"global batch {self.global_batch} = {self.micro_batch} x {self.accumulation} accumulation x "
                f"{self.nproc} ranks; {self.steps} steps per launch: {self.skip} warm-up, then {self.windows} timed "
                f"windows of {self.window} (offload, not timed: {self.steps_of(self.configs[-1].label)}); "
                f"configurations: {', '.join(c.label for c in self.configs)}")


# --------------------------------------------------------------------------------------------- the scripts


def engine_takeover(ddp_lines: list[str], ds_lines: list[str], diff: list[str]) -> dict:
    """``{"written_in_ddp": bool, "left_in_ds": [markers]}`` for :data:`TAKEN_OVER`, from the two scripts' code
    lines and their diff (comments do not count)."""
    code = lambda lines: [line.split("#", 1)[0] for line in lines]
    only_ddp = code(line[1:] for line in diff if line.startswith("-"))
    return {"written_in_ddp": all(any(m in line for line in only_ddp) for m in TAKEN_OVER.values()),
            "left_in_ds": [m for m in TAKEN_OVER.values() if any(m in line for line in code(ds_lines))]}


def claim_engine_takes_over(old: str = "ddp_tuning.py", new: str = "ds_tuning.py") -> None:
    from ..scripts import _code_lines, script_diff

    found = engine_takeover(_code_lines(old), _code_lines(new), script_diff(old, new, context=0))
    print("deepspeed.initialize + engine.backward/step take over:", ", ".join(TAKEN_OVER))
    claim("each of these is written in the DDP script", found["written_in_ddp"])
    claim("none of them is left in the DeepSpeed script", not found["left_in_ds"],
          measured=", ".join(found["left_in_ds"]) or None)


# --------------------------------------------------------------------------------------------- the numbers


def step_times(run) -> dict[int, list[float]]:
    """``{rank: [step_s, ...]}`` in step order."""
    from ...rank import metrics

    out: dict[int, list[float]] = {}
    for r in metrics.steps(run.metrics):
        out.setdefault(r["rank"], []).append(r["step_s"])
    return out


def losses(run) -> dict[int, float]:
    """``{step: loss of the global batch}``: the mean of the ranks' losses (equal per-rank batches)."""
    from ...rank import metrics

    by_step: dict[int, list[float]] = {}
    for r in metrics.steps(run.metrics):
        by_step.setdefault(r["step"], []).append(r["loss"])
    return {s: math.fsum(v) / len(v) for s, v in sorted(by_step.items())}


def speeds(runs: dict, timed: dict, plan: Plan) -> dict[str, dict]:
    """Per timed configuration: ``{"median", "min", "max", "windows"}`` in samples/s, from its timing launch (GPUs)
    or its counted launch (CPUs)."""
    out = {}
    for c in plan.configs:
        if c.timed:
            rates = window_samples_per_s(step_times(timed.get(c.label, runs[c.label])), plan.global_batch,
                                         plan.skip, plan.windows)
            med, lo, hi = median_spread(rates)
            out[c.label] = {"median": med, "min": lo, "max": hi, "windows": rates}
    return out


COLUMNS = (("label", "run", "{}"), ("model_states_mib", "model states MiB/rank", "{:.0f}"),
           ("formula_mib", "formula MiB/rank", "{:.0f}"), ("cuda_peak_mib", "peak GPU MiB/rank", "{:.0f}"),
           ("max_rss_mib", "max RSS MiB/rank", "{:.0f}"), ("rss_start_mib", "RSS before model MiB", "{:.0f}"),
           ("samples_per_s", "samples/s", "{:.0f}"), ("spread", "min-max", "{}"),
           ("comm_mib_per_step", "sent MiB/step/rank", "{:.0f}"), ("checkpoint_mib", "checkpoint MiB", "{:.0f}"))


def rows(runs: dict, speed: dict, plan: Plan) -> list[dict]:
    """One :func:`helpers.notebook.results.summary` row per configuration, with the formula's MiB per rank and the
    timed windows' median and spread (None for the offload rows, which are not timed)."""
    from .. import results

    out = []
    params = runs["DDP"].result["params"]
    for label, run in runs.items():
        row = results.summary(run, label)
        stage = plan.stage(label)
        k = memory.deepspeed_k(stage, "fp32")
        row["formula_mib"] = memory.zero_model_state_bytes(params, plan.nproc, stage, "fp32", k=k)["total"] / 2**20
        s = speed.get(label)
        row["samples_per_s"] = s["median"] if s else None
        row["spread"] = f"{s['min']:.0f}-{s['max']:.0f}" if s else None
        out.append(row)
    return out


def table(runs: dict, speed: dict, plan: Plan) -> list[dict]:
    """Print the measured table; returns its rows (:func:`rows`)."""
    from .. import results

    out = rows(runs, speed, plan)
    print(f"{out[0]['params']:,} parameters, {plan.nproc} ranks, fp32, global batch {plan.global_batch}, "
          f"{plan.steps} steps; samples/s: median of {plan.windows} windows of {plan.window} steps, min-max "
          "(the offload rows are not timed)")
    print(results.table(out, COLUMNS))
    return out


# --------------------------------------------------------------------------------------------- the claims


def loss_parity(curves: dict[str, dict[int, float]], reference: str = "DDP") -> dict[str, dict]:
    """Each curve against ``reference``, within :data:`parity.K` floors; a curve's floor is the largest spread among
    the *other* curves (leave one out), so a run that computes something else cannot widen its own tolerance."""
    out = {}
    for label, curve in curves.items():
        if label == reference:
            continue
        others = [k for k in curves if k != label]
        floor = max(parity.spread_floor(_common(curves[a], curves[b]), _common(curves[b], curves[a]))
                    for i, a in enumerate(others) for b in others[i + 1:])
        out[label] = parity.check(curve, curves[reference], floor)
    return out


def _common(a: dict, b: dict) -> dict:
    return {s: v for s, v in a.items() if s in b}


def whole_grads_overlapping(sizes: list[int], rank: int, nproc: int, bytes_per_element: int = 4) -> int:
    """Bytes of the whole gradients of every parameter tensor (``sizes``, in order) that overlaps ``rank``'s 1/N of
    the flat buffer: what ZeRO-2 keeps on that rank."""
    total, part = sum(sizes), math.ceil(sum(sizes) / nproc)
    start, held = 0, 0
    for s in sizes:
        if start < (rank + 1) * part and start + s > rank * part:
            held += bytes_per_element * s
        start += s
    return held


def partitioned_grads(accumulation: int) -> tuple[str, ...]:
    """The configurations whose gradients are partitioned when the counters run (after the first backward of step
    2): ZeRO-2, and ZeRO-1 too when that backward is the accumulation boundary (A = 1), where it has reduced."""
    return ("ZeRO-2", "ZeRO-1") if accumulation == 1 else ("ZeRO-2",)


def formula_ratios(by_rank: dict[str, dict], params: int, sizes: list[int], plan: Plan) -> tuple[dict, list]:
    """``({label: [measured / formula per rank]}, [ZeRO-2-with-whole-gradients ratios])`` from each configuration's
    ``{rank: model_state_bytes}``; the offload rows are left out (an extra fp32 gradient buffer for the CPU
    optimizer)."""
    ratios, zero2_fit = {}, []
    for label, states in by_rank.items():
        if "offload" in label:
            continue
        for rank, measured in sorted(states.items()):
            cmp = memory.compare_to_formula(measured, params, plan.nproc, plan.stage(label), "fp32")
            ratios.setdefault(label, []).append(cmp["ratio"]["total"])
            if label in partitioned_grads(plan.accumulation):
                f = memory.compare_to_formula(measured, params, plan.nproc, 2, "fp32")["formula"]
                held = f["total"] - f["grads"] + whole_grads_overlapping(sizes, rank, plan.nproc)
                zero2_fit.append(measured["total"] / held)
    return ratios, zero2_fit


def claim_same_math(runs: dict, rows_: list[dict], plan: Plan, sizes: list[int] | None = None) -> None:
    """Loss at every step, global batch, model states against the formula, checkpoint bytes per parameter.
    ``sizes``: the model's parameter tensor sizes (default: :func:`parameter_sizes` of the plan's model)."""
    curves = {label: losses(run) for label, run in runs.items()}
    par = loss_parity(curves)
    worst = max(par.values(), key=lambda r: r["gap"] / r["bound"])
    short = sorted({plan.steps_of(label) for label in curves} - {plan.steps})
    claim(f"every run gives DDP's loss at every step it ran ({plan.steps} steps"
          + "".join(f", {n} for the untimed offload runs" for n in short) + f"; fp32, within {parity.K} x the noise "
          "floor: the largest spread among the other runs)",
          all(sorted(c) == list(range(1, plan.steps_of(label) + 1)) for label, c in curves.items())
          and all(r["ok"] for r in par.values()),
          measured=", ".join(f"{label} {r['gap']:.1e}" for label, r in par.items())
                   + f"; tightest bound {worst['bound']:.1e}")
    claim("same global batch in every run", len({run.result["global_batch"] for run in runs.values()}) == 1)

    params = runs["DDP"].result["params"]
    sizes = sizes or parameter_sizes(plan.params)
    if sum(sizes) != params:
        raise ValueError(f"the tensor sizes add up to {sum(sizes):,} parameters, the runs trained {params:,}")
    by_rank = {label: {r: v["model_state_bytes"] for r, v in run.results_by_rank().items()}
               for label, run in runs.items()}
    ratios, zero2_fit = formula_ratios(by_rank, params, sizes, plan)
    for label, rs in ratios.items():
        print(f"{label:8s} model states measured / formula, each rank: " + ", ".join(f"{x:.3f}" for x in rs))
    split = partitioned_grads(plan.accumulation)
    exact = [label for label in ("DDP", "ZeRO-1", "ZeRO-3") if label in ratios and label not in split]
    claim(f"{', '.join(exact)}: measured / formula is 1.00 on every rank (within 1%)",
          all(abs(x - 1) <= 0.01 for label in exact for x in ratios[label]))
    claim(f"{' and '.join(split)}: measured = ZeRO-2's formula with each rank's gradients replaced by the whole "
          "gradients of the layers its partition overlaps (within 1%, every rank)",
          bool(zero2_fit) and all(abs(x - 1) <= 0.01 for x in zero2_fit),
          measured=", ".join(f"{x:.3f}" for x in zero2_fit) + f"; largest layer {max(sizes) / params:.0%} of the "
                   "parameters")
    ckpt = {r["label"]: r["checkpoint_mib"] * 2**20 / params for r in rows_ if r["label"] in CLAIMED}
    print("checkpoint bytes per parameter:", ", ".join(f"{label} {b:.1f}" for label, b in ckpt.items()))
    claim("checkpoint bytes per parameter: DDP 12, ZeRO-1 and ZeRO-2 16, ZeRO-3 and ZeRO-3 + offload 12 (within 2%)",
          all(abs(b - CHECKPOINT_BYTES[plan.stage(label)]) <= 0.02 * CHECKPOINT_BYTES[plan.stage(label)]
              for label, b in ckpt.items()))


def speed_verdict(speed: dict[str, dict]) -> dict:
    """The speed claims' numbers: each ZeRO median over DDP's, the noise ceiling (1 + the widest relative window
    spread of any configuration, (max - min) / median), and whether each claim holds."""
    ddp = speed["DDP"]["median"]
    ratios = {label: s["median"] / ddp for label, s in speed.items() if label != "DDP"}
    noise = max((s["max"] - s["min"]) / s["median"] for s in speed.values())
    return {"ratios": ratios, "ceiling": 1 + noise, "none_faster": all(0 < r <= 1 + noise for r in ratios.values()),
            "zero3_slower": ratios.get("ZeRO-3", 1.0) < 1}


def claim_speed(speed: dict[str, dict], plan: Plan, runs: dict) -> None:
    timed = plan.windows * plan.window
    claim(f"every timed configuration has {plan.windows} windows of {plan.window} steady-state steps",
          all(len(s["windows"]) == plan.windows for s in speed.values())
          and all(runs[label].result["timed_steps"] == timed for label in speed))
    v = speed_verdict(speed)
    d = speed["DDP"]
    claim("no ZeRO stage's median is above DDP's by more than the widest window spread measured here",
          v["none_faster"], measured=", ".join(f"{label} {r:.2f}x" for label, r in v["ratios"].items())
          + f" of DDP's {d['median']:.0f} samples/s; ceiling {v['ceiling']:.2f}x")
    z3 = speed["ZeRO-3"]
    claim("ZeRO-3's median samples/s is below DDP's", v["zero3_slower"],
          measured=f"ZeRO-3 {z3['median']:.0f} ({z3['min']:.0f}-{z3['max']:.0f}) vs DDP {d['median']:.0f} "
                   f"({d['min']:.0f}-{d['max']:.0f})")


def expected_comm_multiples(accumulation: int, labels) -> dict[str, float]:
    """Bytes per optimizer step as a multiple of DDP's (one all-reduce per step with no_sync), A micro batches."""
    a = accumulation
    rule = {0: 1.0, 1: 1.5, 2: a + 0.5, 3: float(a)}
    out = {}
    for label in labels:
        if label == "DDP":
            continue
        stage = 0 if label == "ZeRO-0" else int(label.split("-")[1][0])
        out[label] = rule[stage]
    return out


def claim_comm(rows_: list[dict], plan: Plan) -> None:
    by = {r["label"]: r for r in rows_}
    expected = expected_comm_multiples(plan.accumulation, [label for label in by if label in CLAIMED])
    print(f"A = {plan.accumulation} micro batches per step: expected multiples of DDP's bytes "
          + ", ".join(f"{label} {m:g}x" for label, m in expected.items()))
    params = by["DDP"]["params"]
    claim("a layer's weights are reused within 2 x params < stage3_max_reuse_distance (1e9), so ZeRO-3 keeps them "
          "from forward to backward and gathers once per micro batch", 2 * params < 1e9,
          measured=f"2 x {params / 1e6:.0f} M parameters")
    if plan.nproc == 1:
        claim("with one rank no configuration sends any bytes", all(r["comm_mib_per_step"] == 0 for r in rows_))
        return
    multiple = {label: by[label]["comm_mib_per_step"] / by["DDP"]["comm_mib_per_step"] for label in expected}
    claim("bytes sent per step as a multiple of DDP's: ZeRO-1 1.5x, ZeRO-2 (A + 0.5)x, ZeRO-3 and ZeRO-3 + offload Ax "
          "(within 5%)", all(abs(multiple[label] - m) <= 0.05 * m for label, m in expected.items()),
          measured=", ".join(f"{label} {m:.2f}x" for label, m in multiple.items()))


def print_memory_by_rank(rows_: list[dict]) -> None:
    """Every rank's model states and peak RSS, one line per configuration."""
    for r in rows_:
        states, peaks = r["model_states_mib_by_rank"], r["max_rss_mib_by_rank"]
        print(f"{r['label']:17s} " + " | ".join(f"rank {k}: states {states[k]:4.0f}, peak RSS {peaks[k]:5.0f}"
                                                for k in states) + " MiB")


def claim_memory(rows_: list[dict], plan: Plan) -> None:
    """Evenness of the model states across ranks; on a CPU, ZeRO-3's RSS paradox."""
    by = {r["label"]: r for r in rows_}
    even = {r["label"]: max(r["model_states_mib_by_rank"].values()) / min(r["model_states_mib_by_rank"].values())
            for r in rows_}
    uneven = partitioned_grads(plan.accumulation)
    claim(f"every configuration but {' and '.join(uneven)} holds the same model states on every rank (within 1%)",
          all(x <= 1.01 for label, x in even.items() if not label.startswith(uneven)),
          measured="largest / smallest " + ", ".join(f"{label} {x:.2f}" for label, x in even.items()))
    if all(r.get("cuda_peak_mib") is not None for r in rows_):
        return  # on a GPU the peak is CUDA's high-water mark of live tensors, not the process
    zero3 = [label for label in by if label.startswith("ZeRO-3")]
    others = [label for label in by if label not in zero3]
    claim("on this CPU the ZeRO-3 runs have the highest peak RSS of all runs (rank 0)",
          min(by[l]["max_rss_mib"] for l in zero3) > max(by[l]["max_rss_mib"] for l in others),
          measured=", ".join(f"{l} {by[l]['max_rss_mib']:.0f}" for l in by) + " MiB")
    if plan.nproc == 1:  # nothing to partition: every ZeRO stage holds everything, plus its fp32 master copy
        zero = [r["model_states_mib"] for r in rows_ if r["label"] != "DDP" and "offload" not in r["label"]]
        z3 = by["ZeRO-3"]["model_states_mib"]
        claim("although with one rank ZeRO-3 saves nothing: as much as the other stages (within 1%), more than DDP "
              "(its fp32 master copy)", abs(z3 - min(zero)) <= 0.01 * min(zero) and z3 > by["DDP"]["model_states_mib"])
    else:
        claim("although ZeRO-3 holds the fewest model states per rank",
              by["ZeRO-3"]["model_states_mib"] == min(r["model_states_mib"] for r in rows_))


# --------------------------------------------------------------------------------------------- the blog's table


def blog_table(rows_: list[dict], plan: Plan) -> str:
    """The seed blog's comparison table, row by row: what it said, what this run measured, the source."""
    from ..scripts import script_diff

    by = {r["label"]: r for r in rows_}
    d, z2, z3 = by["DDP"], by["ZeRO-2"], by["ZeRO-3"]
    pct = lambda r: f"{1 - r['model_states_mib'] / d['model_states_mib']:.0%}"
    x = lambda r: f"{r['comm_mib_per_step'] / d['comm_mib_per_step']:.1f}x" if d["comm_mib_per_step"] else "-"
    rate = lambda r: f"{r['samples_per_s']:.0f} ({r['spread']})"
    diff = script_diff("ddp_tuning.py", "ds_tuning.py", context=0)
    added = sum(line.startswith("+") and line[1:].strip() != "" for line in diff)
    return f"""| | blog said | measured here ({plan.nproc} ranks, {d['params'] / 1e6:.0f} M params, fp32) | source, and what this machine cannot show |
|---|---|---|---|
| ease of use | DDP: sampler + process group; DeepSpeed: "one line" | {added} lines in, engine takes over wrapper, optimizer, scheduler, clipping, precision, accumulation; its defaults can change results (clipping at 1.0) | [PR #8068](https://github.com/microsoft/DeepSpeed/pull/8068) |
| memory saving | ZeRO-2 ~40%, ZeRO-3 ~60-75% | model states: ZeRO-2 {pct(z2)}, ZeRO-3 {pct(z3)} less than DDP; max RSS: DDP {d['max_rss_mib']:.0f}, ZeRO-2 {z2['max_rss_mib']:.0f}, ZeRO-3 {z3['max_rss_mib']:.0f} MiB | formula, mixed precision: 43.8% / 50.0% at 2 ranks, 76.6% / 87.5% at 8 ([arXiv:1910.02054](https://arxiv.org/abs/1910.02054) Sec. 5); on a CPU, RSS is mostly the framework |
| communication | DDP lowest latency; ZeRO-2/3 "still efficient" | bytes per step: DDP {d['comm_mib_per_step']:.0f} MiB, ZeRO-2 {x(z2)}, ZeRO-3 {x(z3)} (A = {plan.accumulation}); samples/s, median (min-max): DDP {rate(d)}, ZeRO-2 {rate(z2)}, ZeRO-3 {rate(z3)} | paper: 2Ψ for DDP and ZeRO-1/2, 3Ψ for ZeRO-3 (Sec. 7); ranks on one CPU talk through memory, so no network cost shows |
| model size | DDP < 2 B params; DeepSpeed 2-10 B | states of mixed-precision Adam in 80 GB: DDP 5 B params on any number of GPUs; ZeRO-3 40 B on 8, 320 B on 64; "Qwen2-72B on 8 GPUs with ZeRO-3" needs 1.15 TB against 640 GB (section 4) | activations and buffers lower these; the paper trains over 100 B parameters on 400 GPUs (abstract) |
| debuggability | DDP clear; DeepSpeed "deeper wrapping" | DDP: `model.parameters()` are the full weights; ZeRO-3: placeholders outside forward, shards in `ds_tensor` | `deepspeed.zero.GatheredParameters` reads them ([ZeRO docs](https://deepspeed.readthedocs.io/en/latest/zero3.html)) |
"""


def parameter_sizes(params: int) -> list[int]:
    """The sizes of the wide MLP's parameter tensors, in order, from its shapes on the meta device (nothing is
    allocated): where ZeRO-2's partition boundaries fall."""
    import torch

    from ...rank import models

    with torch.device("meta"):
        return [p.numel() for p in models.make_memory_model(params).parameters()]
