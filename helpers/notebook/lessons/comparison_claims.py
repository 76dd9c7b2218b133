"""Notebook 04's claims on the measured runs (:mod:`helpers.notebook.lessons.comparison` plans and measures them,
and re-exports every name here, so a notebook cell calls ``comparison.claim_same_math``): loss parity with DDP,
model states against the ZeRO formula, checkpoint bytes per parameter, bytes sent per step, the timed windows'
speeds, the memory per rank, and the seed blog's table filled in with what was measured.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ...calc import memory, parity
from ..checks import claim

if TYPE_CHECKING:
    from .comparison import Plan

# checkpoint bytes per parameter in fp32: DDP weights + Adam's m, v (12); ZeRO-1/2 also the fp32 master copy (16);
# ZeRO-3 the master copy and the moments, not the module's placeholders (12)
CHECKPOINT_BYTES = {0: 12, 1: 16, 2: 16, 3: 12}
# the configurations both profiles run: the claims name these (the full profile's ZeRO-0 and ZeRO-2 + offload are shown)
CLAIMED = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "ZeRO-3 + offload")


def losses(run) -> dict[int, float]:
    """``{step: loss of the global batch}``: the mean of the ranks' losses (equal per-rank batches)."""
    from ...rank import metrics

    by_step: dict[int, list[float]] = {}
    for r in metrics.steps(run.metrics):
        by_step.setdefault(r["step"], []).append(r["loss"])
    return {s: math.fsum(v) / len(v) for s, v in sorted(by_step.items())}


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
