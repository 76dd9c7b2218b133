"""Notebook 07's loss parity (:mod:`helpers.notebook.lessons.fsdp2` re-exports these, so a cell calls
``lesson.claim_same_losses``): the global batch's loss per step, and the three claim lines that hold DDP, DeepSpeed
ZeRO-3, FSDP2 and the resharded resume to one process's curve.

Float addition is not associative, so DDP, DeepSpeed ZeRO-3 and FSDP2 on N ranks, summing the same global batches
in another order than one process, drift from the one-process fp32 curve, though in exact arithmetic they compute
the same losses. The notebook runs the one-process reference, the FSDP2 run and the resumed run in fp32 and in
fp64; the largest distance of an fp32 run from its fp64 twin is the noise floor of fp32 rounding for this
computation, the fp64 runs must agree within :func:`helpers.calc.parity.fp64_bound`, and every fp32 curve within
:data:`helpers.calc.parity.K` floors of the one-process fp32 curve (:mod:`helpers.calc.parity` says why).
"""
from __future__ import annotations

import statistics

from ...calc import parity
from ...rank import metrics
from ..checks import claim


def global_losses(run) -> list[float]:
    """The loss of the global batch per step, in step order: the mean of the ranks' losses (equal per-rank
    batches)."""
    by_step: dict[int, list[float]] = {}
    for r in metrics.steps(run.metrics):
        by_step.setdefault(r["step"], []).append(r["loss"])
    return [statistics.fmean(v) for _, v in sorted(by_step.items())]


def claim_same_losses(one: list[float], one64: list[float], first: dict[str, list[float]], again: list[float], *,
                      first64: list[float], again64: list[float], resumed_from: int, nproc: int,
                      resume_nproc: int) -> dict:
    """Three claim lines. ``one``/``one64``: the one-process reference over all steps, in fp32 and fp64; ``first``:
    each system's curve on ``nproc`` ranks over the first half, ``first64`` FSDP2's fp64 twin of it; ``again`` and
    ``again64``: the run resumed on ``resume_nproc`` ranks over the second half, in fp32 and fp64. The floor of each
    half is :func:`helpers.calc.parity.twin_floor` over the fp32/fp64 pairs of its steps. Returns the
    :func:`helpers.calc.parity.check` results by label."""
    steps = len(one) // 2
    if len(one64) != len(one) or len(first64) != steps or len(again64) != steps:
        raise ValueError(f"the fp64 twins ran {len(one64)}, {len(first64)} and {len(again64)} steps: run the fp32 "
                         f"runs' steps ({len(one)}, {steps}, {steps})")
    full = {label: len(curve) == steps for label, curve in list(first.items()) + [("resumed", again)]}
    floor_first = parity.twin_floor((one[:steps], one64[:steps]), (first["FSDP2"], first64)) if full["FSDP2"] \
        else parity.floor(one[:steps], one64[:steps])
    floor_all = parity.twin_floor((one, one64), (again, again64)) if full["resumed"] else parity.floor(one, one64)

    fp64 = {f"FSDP2 on {nproc}": parity.check(first64, one64[:steps], floor_first,
                                              bound=parity.fp64_bound(floor_first)),
            f"resumed on {resume_nproc}": parity.check(again64, one64[steps:], floor_all,
                                                       bound=parity.fp64_bound(floor_all))}
    claim(f"in fp64, FSDP2 on {nproc} ranks and its checkpoint resumed on {resume_nproc} ranks give the one-process "
          f"fp64 loss at every step, within {parity.K} x the fp32 floor x 2^-29",
          all(r["ok"] for r in fp64.values()),
          measured=", ".join(f"{label} {r['gap']:.1e} (bound {r['bound']:.1e})" for label, r in fp64.items()))

    out = {label: parity.check(curve, one[:steps], floor_first) if full[label] else None
           for label, curve in first.items()}
    gaps = ", ".join(f"{label} " + ("missing steps" if r is None else f"{r['gap']:.1e}") for label, r in out.items())
    claim(f"DDP, DeepSpeed ZeRO-3 and FSDP2 on {nproc} ranks give one process's loss at every one of the {steps} "
          f"steps (fp32, within {parity.K} x the noise floor of fp32 rounding)",
          all(r is not None and r["ok"] for r in out.values()),
          measured=f"{gaps}; floor {floor_first:.1e} (fp32 vs fp64 twins, steps 1-{steps}), "
                   f"bound {parity.K * floor_first:.1e}")
    resumed = parity.check(again, one[steps:], floor_all) if full["resumed"] else None
    out[f"resumed on {resume_nproc}"] = resumed
    claim(f"the run resumed on {resume_nproc} ranks from the {nproc}-rank checkpoint starts at step {steps} and "
          f"continues the one-process curve for steps {steps + 1}-{2 * steps} (within {parity.K} x the noise floor)",
          resumed_from == steps and resumed is not None and resumed["ok"],
          measured=("missing steps" if resumed is None else f"{resumed['gap']:.1e}") +
                   f"; floor {floor_all:.1e} (steps 1-{2 * steps}), bound {parity.K * floor_all:.1e}")
    out.update({f"fp64 {label}": r for label, r in fp64.items()})
    return out
