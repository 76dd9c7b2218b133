"""Notebook 07, "A run that pays off on a laptop": the same memory cap on every rank; DDP cannot train within it,
DeepSpeed ZeRO-3 and FSDP2 can.

The arithmetic is the ZeRO formula (:func:`helpers.calc.memory.zero_model_state_bytes`) in fp32 with Adam, with
the K each framework keeps (:func:`helpers.calc.memory.deepspeed_k`):

    DDP        (4 + 4 + 8) P        = 16 P   bytes per rank (nothing is sharded)
    ZeRO-3     (4 + 4 + 12) P / N   = 20 P / N  (DeepSpeed's fp32 master copy of its partition: K = 12)
    FSDP2      (4 + 4 + 8) P / N    = 16 P / N

Every rank of the sharded runs first builds the whole fp32 model (4 P) and only then shards it (no meta-device init,
no ``deepspeed.zero.Init``), so their peak is at most 4 P + their model states (:func:`peaks_bytes`).

The cap each rank gets (``COURSE_MEMORY_CAP_MIB``, applied inside the rank by :mod:`helpers.rank.memcap` above
the rank's own start-up footprint) is halfway between the larger sharded peak (ZeRO-3's) and DDP's 16 P, plus an
allowance for what the frameworks start after the cap is set and the formula does not count: FSDP2 starts 8 threads
at its first all-gather (measured), and every thread's stack is ``RLIMIT_STACK`` (8 MiB by default) of private
memory, so the allowance is 8 stacks. The model is sized so that the half gap is twice that allowance: DDP's formula
need lies one allowance above the cap, the sharded peaks three allowances below it. The optimizer step's
temporaries are kept small by construction: 16 layers (no layer over a few percent of the model) and DeepSpeed's
ZeRO-3 step in tiles (``--sub-group-size``; by default it flattens and updates the whole partition at once, which
costs up to 12 bytes more per element at the peak).

Measured here (VmData above the start-up footprint, peak of 2 optimizer steps, no cap): 2 ranks, 43.4 M parameters:
DDP 663 MiB (formula 662), ZeRO-3 605-624 (formula 413, + 4 P = 579), FSDP2 412-426 (formula 331, + 4 P = 496).
So at 2 ranks ZeRO-3's peak (14 P) sits too close to DDP's 16 P for one cap between them to hold on every machine:
the demonstration runs on at least :data:`MIN_RANKS` = 3 ranks (:func:`plan` says so when asked for fewer; one
rank has nothing to shard over at all).

Example (a notebook cell)::

    from helpers.notebook.lessons import memcap as lesson
    plan = lesson.plan(NPROC)          # model size and cap from the formula, printed
    outcome = lesson.run(plan)         # DDP, ZeRO-3, FSDP2 under the cap: 2 optimizer steps each
    lesson.show(outcome)               # how each ended (durations: an nbval-ignored cell)
    lesson.claim_outcome(plan, outcome)
"""
from __future__ import annotations

import resource
from dataclasses import dataclass

from ...calc.memory import deepspeed_k, zero_model_state_bytes
from ..checks import claim

MIB = 2**20
FRAMEWORK_THREADS = 8      # threads FSDP2 starts at its first all-gather, after the cap is set (measured)
DEFAULT_STACK = 8 * MIB    # glibc's thread stack when RLIMIT_STACK is unlimited
DEPTH = 16                 # layers of the wide MLP: the largest layer stays a few percent of the model
STEPS = 2                  # optimizer steps: the second runs with every state allocated
NAMED_ERROR = "out of memory within the cap of"
SCRIPTS = {"DDP": "course/ddp_tuning.py", "ZeRO-3": "course/ds_tuning.py", "FSDP2": "course/fsdp2_cifar10.py"}
FRAMEWORK_ARGS = {"DDP": [], "ZeRO-3": ["--stage", 3, "--bucket-size", 2_000_000, "--sub-group-size", 1_000_000],
                  "FSDP2": ["--test-size", 8]}
SHARDED = ("ZeRO-3", "FSDP2")
MIN_RANKS = 3              # at 2, ZeRO-3's peak (4 P + 20 P / 2 = 14 P) is too close to DDP's 16 P


def stack_bytes() -> int:
    """A thread's stack in bytes: the soft ``RLIMIT_STACK`` (glibc's default for new threads)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_STACK)
    return DEFAULT_STACK if soft in (resource.RLIM_INFINITY, -1) or soft <= 0 else int(soft)


def needs_bytes(params: float, nproc: int) -> dict[str, float]:
    """Model-state bytes per rank by the formula, fp32 Adam: DDP (stage 0), ZeRO-3 (K = 12), FSDP2 (K = 8).

    Example::

        needs_bytes(1e6, 2)   # {'DDP': 16e6, 'ZeRO-3': 10e6, 'FSDP2': 8e6}
    """
    return {"DDP": zero_model_state_bytes(params, nproc, 0, "fp32", k=deepspeed_k(0, "fp32"))["total"],
            "ZeRO-3": zero_model_state_bytes(params, nproc, 3, "fp32", k=deepspeed_k(3, "fp32"))["total"],
            "FSDP2": zero_model_state_bytes(params, nproc, 3, "fp32")["total"]}


def peaks_bytes(params: float, nproc: int) -> dict[str, float]:
    """The most a rank can hold by the formula: its model states, plus, for the sharded runs, the whole fp32 model
    (4 P) that every rank builds before the framework shards it (no meta-device init, no ``deepspeed.zero.Init``):
    an upper bound, as the whole model is freed while the shards take its place."""
    need = needs_bytes(params, nproc)
    return {k: v + (4 * params if k in SHARDED else 0) for k, v in need.items()}


def cap_bytes(params: float, nproc: int, allowance: float) -> float:
    """Halfway between the larger sharded peak and DDP's, plus ``allowance``."""
    peak = peaks_bytes(params, nproc)
    return (peak["DDP"] + max(peak[s] for s in SHARDED)) / 2 + allowance


def params_for(nproc: int, allowance: float) -> float:
    """The parameter count whose half gap (DDP's peak minus the cap's midpoint) is twice ``allowance``."""
    if nproc < MIN_RANKS:
        raise ValueError(f"the cap separates DDP from ZeRO-3 only from {MIN_RANKS} ranks on")
    peak = peaks_bytes(1, nproc)
    return 2 * allowance / ((peak["DDP"] - max(peak[s] for s in SHARDED)) / 2)


@dataclass(frozen=True)
class Plan:
    nproc: int            # ranks of the demonstration (at least 2)
    asked: int            # the nproc the notebook asked for
    params: int           # exact parameters of the wide MLP
    width: int
    allowance_mib: float  # 8 thread stacks
    cap_mib: float        # COURSE_MEMORY_CAP_MIB: above each rank's start-up footprint
    need_mib: dict        # the formula's model states per rank, per framework
    peak_mib: dict        # plus the whole model the sharded runs build before sharding

    def env(self, label: str) -> dict:
        """The ranks' environment: the cap, the formula's need for the rank's message, and CPU ranks (gloo) even on
        a GPU machine: the cap is on host memory."""
        return {"CUDA_VISIBLE_DEVICES": "", "COURSE_MEMORY_CAP_MIB": f"{self.cap_mib:.0f}", "COURSE_MEMORY_NEED_MIB": f"{self.need_mib[label]:.0f}"}

    def lines(self) -> list[str]:
        n, p = self.nproc, self.params / 1e6
        out = [] if self.asked >= MIN_RANKS else [
            f"{self.asked} rank{'s' if self.asked > 1 else ''} asked for: this runs on {n} (at 2, ZeRO-3's peak of 4 P + 20 P / 2 = 14 P lies too close "
            f"to DDP's 16 P for one cap between them; one rank has nothing to shard)"]
        out += [f"wide MLP of {DEPTH} layers, width {self.width}: P = {self.params:,} parameters, {n} ranks, fp32 Adam",
                f"  DDP     16 P     = {self.need_mib['DDP']:6.0f} MiB per rank",
                f"  ZeRO-3  20 P / {n} = {self.need_mib['ZeRO-3']:6.0f} MiB per rank, "
                f"+ 4 P (the whole model, before sharding) = {self.peak_mib['ZeRO-3']:6.0f} MiB at most",
                f"  FSDP2   16 P / {n} = {self.need_mib['FSDP2']:6.0f} MiB per rank, "
                f"+ 4 P (the whole model, before sharding) = {self.peak_mib['FSDP2']:6.0f} MiB at most",
                f"cap = (DDP + ZeRO-3 at most) / 2 + {FRAMEWORK_THREADS} thread stacks of "
                f"{self.allowance_mib / FRAMEWORK_THREADS:.0f} MiB = {self.cap_mib:.0f} MiB per rank, "
                f"above its start-up footprint ({p:.1f} M parameters: half gap = 2 x the allowance)"]
        return out


def plan(nproc: int | None, *, allowance: float | None = None) -> Plan:
    """Model size and cap for ``nproc`` ranks (at least 2), from the formula; prints the arithmetic.

    Example::

        plan(2).cap_mib    # ~650 (with 8 MiB thread stacks)
    """
    import torch

    from ...rank.models import count_parameters, make_memory_model

    asked = nproc or 2
    n = max(MIN_RANKS, asked)
    allowance = FRAMEWORK_THREADS * stack_bytes() if allowance is None else allowance
    with torch.device("meta"):
        model = make_memory_model(int(params_for(n, allowance)), DEPTH)
    params = count_parameters(model)
    out = Plan(nproc=n, asked=asked, params=params, width=model.width, allowance_mib=allowance / MIB,
               cap_mib=cap_bytes(params, n, allowance) / MIB,
               need_mib={k: v / MIB for k, v in needs_bytes(params, n).items()},
               peak_mib={k: v / MIB for k, v in peaks_bytes(params, n).items()})
    print("\n".join(out.lines()))
    return out


def run(plan: Plan, scripts: dict | None = None, *, timeout: float = 600) -> dict:
    """Launch DDP, ZeRO-3 and FSDP2 under the plan's cap (torchrun, :data:`STEPS` steps each): ``{label: Run}`` for
    a run that trained, ``{label: LaunchError}`` for one that stopped."""
    from ... import launch

    scripts = {**SCRIPTS, **(scripts or {})}
    common = ["--dataset", "synthetic", "--train-size", 4 * STEPS * plan.nproc, "--batch-size", 4,
              "--model", "memory", "--params", plan.params, "--depth", DEPTH, "--steps", STEPS, "--skip-steps", 0]

    def start(label):
        def go():
            try:
                return launch.torchrun(scripts[label], nproc=plan.nproc, args=common + FRAMEWORK_ARGS[label],
                                       env=plan.env(label), timeout=timeout, stall_timeout=180, show="none",
                                       name=f"07_memcap_{label.lower()}")
            except launch.LaunchError as error:
                return error
        return go

    labels = ("DDP", "ZeRO-3", "FSDP2")  # untimed, each under its own cap: side by side on a CPU
    return dict(zip(labels, launch.side_by_side(*map(start, labels))))


def named_line(error) -> str | None:
    """The rank's own line naming the cap, from a launch's error message (None if it has none)."""
    for line in str(error).splitlines():
        if NAMED_ERROR in line:
            return line.strip().removeprefix("RankOutOfMemory: ").removeprefix("helpers.rank.memcap.RankOutOfMemory: ")
    return None


def show(outcome: dict) -> None:
    """One line per run: how it ended (machine-dependent: durations and footprints; an nbval-ignored cell)."""
    for label, run in outcome.items():
        if isinstance(run, Exception):
            print(f"{label:7s} stopped: {named_line(run) or str(run).splitlines()[0]}")
        else:
            print(f"{label:7s} trained {STEPS} steps in {run.duration_s:.0f} s, model states "
                  f"{_states_mib(run):.0f} MiB per rank")


def claim_outcome(plan: Plan, outcome: dict) -> dict:
    """The claim lines: DDP stopped with the named error, the sharded runs trained every step within the cap, and
    their measured model states lie below it. Returns the verdicts by name (for tests)."""
    from ... import launch

    ddp = outcome["DDP"]
    named = isinstance(ddp, launch.LaunchError) and NAMED_ERROR in str(ddp)
    trained = {label: not isinstance(outcome[label], Exception) and _trained(outcome[label]) for label in SHARDED}
    states = {label: _states_mib(outcome[label]) for label in SHARDED if trained[label]}
    verdicts = {"ddp_stopped": named, "sharded_trained": all(trained.values()),
                "states_below_cap": len(states) == len(SHARDED) and all(s < plan.cap_mib for s in states.values())}
    claim("DDP stops within the cap with a named out-of-memory error ('rank R: out of memory within the cap ...')",
          verdicts["ddp_stopped"])
    claim(f"DeepSpeed ZeRO-3 and FSDP2 train all {STEPS} optimizer steps within the same cap",
          verdicts["sharded_trained"], measured=", ".join(f"{k} {'trained' if v else 'stopped'}"
                                                         for k, v in trained.items()))
    claim("their measured model states per rank lie below the cap, as the formula says",
          verdicts["states_below_cap"],
          measured=", ".join(f"{k} {v:.0f} MiB" for k, v in states.items()) + f" vs cap {plan.cap_mib:.0f} MiB")
    return verdicts


def _trained(run) -> bool:
    from ...rank import metrics

    return run.returncode == 0 and len(metrics.steps(run.metrics, 0)) == STEPS


def _states_mib(run) -> float:
    return max(r["model_state_bytes"]["total"] for r in run.results_by_rank().values()) / MIB
