"""Notebook 04 (DDP vs DeepSpeed, measured): the launches' flags, the table, the plot and the claim lines (the
claims are written in :mod:`helpers.notebook.lessons.comparison_claims`; this module re-exports them).

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

from dataclasses import dataclass, field
from pathlib import Path

from ...calc import memory
from ...calc.throughput import median_spread, window_samples_per_s
from ..checks import claim
# the claims on the measured runs live in comparison_claims.py; notebook 04 calls them through this module
from .comparison_claims import (CHECKPOINT_BYTES, CLAIMED, blog_table, claim_comm, claim_memory,  # noqa: F401
                                claim_same_math, claim_speed, expected_comm_multiples, formula_ratios, loss_parity,
                                losses, parameter_sizes, partitioned_grads, print_memory_by_rank, speed_verdict,
                                whole_grads_overlapping)

# what deepspeed.initialize and engine.backward/step take over: each is written in the DDP script, none in the DS one
TAKEN_OVER = {"the DDP wrapper": "DDP(", "accumulation without all-reduce": "no_sync()",
              "mixed precision": "torch.autocast", "clipping": "clip_grad_norm_", "the LR scheduler": "LambdaLR",
              "the optimizer": "torch.optim.AdamW", "its step": "optimizer.step()", "zero_grad": "zero_grad",
              "backward": "loss.backward()"}


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
