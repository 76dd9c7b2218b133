"""Notebook 05 (tuning): the flags, plots, tables and claim lines its cells call, one group per section.

Every claim is phrased to hold at each value the parameters cell offers (1-4 ranks, either profile, generated data
or CIFAR-10). Timings are medians with min-max of consecutive windows inside ONE launch
(:func:`helpers.calc.throughput.window_samples_per_s`), not one launch per repeat.

Section 3 (warmup): three runs of SimpleCNN with AdamW at a rate ten times a usual one: without warmup, with
``LambdaLR`` warmup (DDP) and with DeepSpeed's ``WarmupLR`` (ZeRO-2, bf16). What holds however the batches fall:

* the schedules are the formulas of :mod:`helpers.calc.schedules`, step for step;
* without warmup the first full-rate Adam step (step 0's update) moves every weight by about the rate, and step 1's
  gradient norm jumps more than tenfold;
* with warmup, both schedules start at rate 0 and climb linearly; while the rate is below half its full value the
  norm stays below a tenth of that jump (measured on the generated data: at most 2.9 against a jump to 70.5 with 3
  ranks, 2.8 against 100.3 with 1);
* the rate is still too high: each warmup run's largest norm comes at a step whose rate is at least half the full
  one, so warmup moves the trouble to where the rate is high rather than removing it; that spike stays below the one
  without warmup, in gradient norm and in loss, and both warmup runs end lower.

Which high-rate step carries the largest norm, late in warmup or after it, depends on the ranks' batches, so no
claim names one (with 3 ranks on the generated data, the DeepSpeed run's came three steps before its rate was full).

Example (a notebook cell)::

    from helpers.notebook.lessons import tuning
    curves = tuning.warmup_curves({"plain": adam_plain, "ddp": adam_warm, "ds": adam_warm_ds})
    tuning.claim_warmup(curves, lr=0.01, warmup_steps=10)
"""
from __future__ import annotations

import math

from ...calc import parity, schedules
from ...calc.throughput import median_spread, window_samples_per_s
from ...rank import metrics
from .. import plots
from ..checks import claim

HALF = 0.5  # "a high rate": at least this fraction of the full one ("half" in the claims)
MLP_SKIP, MLP_WINDOWS = 2, 3  # MLP timing: AdamW's state is created in step 1; 3 windows of the steps after
CNN_SKIP, CNN_WINDOWS = 5, 5  # CNN timing: compilation, allocator and first-bucket warm-up; 5 windows after


def flags(profile: str, dataset: str, batch_size: int, steps: int, *, warmup_steps: int, data_root) -> tuple:
    """``(cnn, mlp)``: the flags of the SimpleCNN runs and of the wide MLP of section 1 (10 M parameters in the
    smoke profile, 200 M in the full one; 8 AdamW steps). Refuses fewer steps than the warmup section compares."""
    if steps < warmup_steps + 10:
        raise ValueError(f"STEPS={steps} is too few: the warmup section compares the {warmup_steps} warmup steps "
                         f"with the 10 after them, so it needs STEPS >= {warmup_steps + 10}")
    data = ["--dataset", dataset, "--data-root", data_root, "--batch-size", batch_size,
            "--train-size", 4000 if profile == "smoke" else 50000]
    mlp = data + ["--model", "memory", "--params", 10_000_000 if profile == "smoke" else 200_000_000,
                  "--steps", 8, "--optimizer", "adamw", "--lr", 1e-3]
    return data + ["--steps", steps], mlp


def _step_s_by_rank(run) -> dict:
    records = metrics.steps(run.metrics)
    return {k: [r["step_s"] for r in records if r["rank"] == k] for k in sorted({r["rank"] for r in records})}


def window_step_s(run, skip: int, windows: int) -> tuple[float, float, float]:
    """(median, min, max) seconds per step of the slowest rank over ``windows`` consecutive windows of one run,
    after its first ``skip`` steps."""
    rates = window_samples_per_s(_step_s_by_rank(run), samples_per_step=1, skip=skip, windows=windows)
    return median_spread(1 / r for r in rates)


def _on_gpu(run) -> bool:
    return "cuda_peak_mib" in metrics.steps(run.metrics)[0]


# --------------------------------------------------------------------------------------------- 1. memory


def plot_memory(run):
    """Each rank's memory after every step (GPU: peak allocated; CPU: RSS), with rank 0's memory before the model
    and that plus its model states."""
    gpu = _on_gpu(run)
    fig = plots.loss_per_rank(run.metrics, field="cuda_peak_mib" if gpu else "rss_mib",
                              title="memory of each rank after every optimizer step (fp32 MLP, AdamW)")
    ax = fig.axes[0]
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("peak GPU memory allocated (MiB)" if gpu else "process resident memory, RSS (MiB)")
    base = 0 if gpu else run.result["rss_start_mib"]
    if not gpu:
        ax.axhline(base, color="k", ls=":", lw=1, label="rank 0 before the model")
    ax.axhline(base + run.result["model_state_bytes"]["total"] / 2**20, color="tab:green", ls="--", lw=1,
               label="... plus its model states")
    ax.set_ylim(0, None)
    ax.legend(fontsize=8)
    return fig


def claim_memory(run, nproc: int) -> None:
    """Section 1's check lines: every rank reported every step; rank 0 sits above its start by at least the model
    states from step 1 on, and moves by less than their size after that."""
    records, states, params = metrics.steps(run.metrics), run.result["model_state_bytes"], run.result["params"]
    steps = sorted({r["step"] for r in records})
    print(f"the MLP has {params:,} parameters: {states['params'] / params:.0f} B weights + "
          f"{states['grads'] / params:.0f} B gradients + {states['optimizer'] / params:.0f} B AdamW state each")
    claim("every rank reported its memory at every step",
          sorted((r["rank"], r["step"]) for r in records if "rss_mib" in r) == [(k, s) for k in range(nproc)
                                                                                for s in steps])
    gpu = _on_gpu(run)  # on a GPU the model states are device memory (tensors allocated now), on a CPU the process
    mem = [r["cuda_mib" if gpu else "rss_mib"] for r in records if r["rank"] == 0]
    above = min(mem) - (0 if gpu else run.result["rss_start_mib"])
    claim("from the first step on, rank 0 sits above its memory before the model by at least the model states",
          above * 2**20 >= states["total"], measured=f"{above:.0f} MiB above, model states {states['total'] / 2**20:.0f} MiB")
    claim("after that, rank 0's memory moves by less than the size of the model states (nothing keeps growing)",
          (max(mem) - min(mem)) * 2**20 < states["total"], measured=f"range {max(mem) - min(mem):.0f} MiB")


# --------------------------------------------------------------------------------------------- 2. clipping


def _field(run, name: str) -> list:
    return [r[name] for r in metrics.steps(run.metrics, 0)]


def plot_clipping(runs: dict):
    """Loss and gradient norm (before clipping) per step of rank 0, one line per ``{label: run}``."""
    plt = plots._plt()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.6))
    records = {label: run.metrics for label, run in runs.items()}
    plots.curves(records, "loss", ax=a, title="training loss, SGD lr 0.2 (rank 0)")
    a.set_ylabel("cross-entropy loss")
    plots.curves(records, "grad_norm", ax=b, logy=True, title="gradient norm before clipping (rank 0)")
    b.set_ylabel("global L2 norm of the gradient")
    b.axhline(1.0, color="k", ls=":", lw=1, label="clipping threshold 1.0")
    b.legend(fontsize=8)
    fig.tight_layout()
    return fig


def claim_clipping(plain, clipped, clipped_ds, clipped64) -> None:
    """Section 2's check lines: no learning without clipping, learning with either framework's clipping, and the
    same norms from both within :data:`parity.K` floors (``clipped64``: the DDP run's fp64 twin, its first steps)."""
    loss_plain, loss_clip, loss_ds = (_field(r, "loss") for r in (plain, clipped, clipped_ds))
    claim("without clipping the loss spiked above twice its starting value", max(loss_plain) > 2 * loss_plain[0])
    claim("without clipping, the last 10 steps average a loss above 2.0 (chance level is ln 10 = 2.30): it is not "
          "learning", _tail(loss_plain) > 2.0, measured=f"{_tail(loss_plain):.3g}")
    claim("with clip_grad_norm_ the last 10 steps average below 1.0", _tail(loss_clip) < 1.0)
    claim("with DeepSpeed's gradient_clipping too", _tail(loss_ds) < 1.0)
    norm_clip, norm_ds = _field(clipped, "grad_norm"), _field(clipped_ds, "grad_norm")
    claim("the reported norms exceed 1.0 on some steps, so clipping did act", max(norm_clip) > 1.0)
    floor = parity.floor(norm_clip[:5], _field(clipped64, "grad_norm")[:5])
    same = parity.check(norm_ds[:5], norm_clip[:5], floor)
    claim(f"DDP and DeepSpeed report the same norms for the first 5 steps (within {parity.K} x the fp32 floor, "
          "measured against DDP's fp64 twin)", same["ok"], measured=parity.describe(same))


# --------------------------------------------------------------------------------------------- 3. warmup


def plot_warmup(runs: dict, warmup_steps: int):
    """Rate, loss and gradient norm per step of rank 0, one line per ``{label: run}``, warmup's end marked."""
    plt = plots._plt()
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(13, 3.6))
    records = {label: run.metrics for label, run in runs.items()}
    plots.curves(records, "lr", ax=a, title="learning rate per step")
    a.set_xlim(-0.5, 2 * warmup_steps)
    a.set_ylabel("learning rate")
    plots.curves(records, "loss", ax=b, title="training loss, AdamW lr 0.01 (rank 0)")
    b.set_ylabel("cross-entropy loss")
    plots.curves(records, "grad_norm", ax=c, logy=True, title="gradient norm before clipping (rank 0)")
    c.set_ylabel("global L2 norm of the gradient")
    for panel in (b, c):
        panel.axvline(warmup_steps, color="k", ls=":", lw=1, label=f"warmup ends (step {warmup_steps})")
        panel.legend(fontsize=7)
    fig.tight_layout()
    return fig


def warmup_curves(runs: dict) -> dict:
    """``{"plain" | "ddp" | "ds": run}`` -> the same keys with rank 0's per-step ``lr``, ``loss`` and ``grad_norm``
    lists."""
    out = {}
    for key, run in runs.items():
        steps = metrics.steps(run.metrics, 0)
        out[key] = {field: [r[field] for r in steps] for field in ("lr", "loss", "grad_norm")}
    return out


def _tail(xs, n=10):
    return sum(xs[-n:]) / len(xs[-n:])


def claim_warmup(curves: dict, *, lr: float, warmup_steps: int) -> dict:
    """The check lines of section 3 (see the module docstring); returns the measured values by name."""
    W = warmup_steps
    plain, ddp, ds = curves["plain"], curves["ddp"], curves["ds"]
    claim("DDP's rates follow lr * min(1, k / W)",
          all(math.isclose(x, schedules.torch_warmup_lr(k, lr, W), abs_tol=1e-12) for k, x in enumerate(ddp["lr"])))
    claim("DeepSpeed's WarmupLR follows lr * min(1, (k - 1) / W), one step later",
          all(math.isclose(x, schedules.deepspeed_warmup_lr(k, lr, W), abs_tol=1e-12) for k, x in enumerate(ds["lr"])))
    print("first rates, DDP:      ", [round(x, 4) for x in ddp["lr"][:5]])
    print("first rates, DeepSpeed:", [round(x, 4) for x in ds["lr"][:5]])

    n_plain, loss_plain = plain["grad_norm"], plain["loss"]
    spike = n_plain[1]
    claim("without warmup, the loss rises to over twice its starting value", max(loss_plain) > 2 * loss_plain[0],
          measured=f"largest {max(loss_plain):.2f}, step 0 {loss_plain[0]:.2f}")
    claim("without warmup, step 1's gradient norm is over 10x step 0's", spike > 10 * n_plain[0],
          measured=f"{spike / n_plain[0]:.0f}x")

    def calm(curve):  # the largest norm while the rate is below HALF of the full one
        return max(n for n, x in zip(curve["grad_norm"], curve["lr"]) if x < HALF * lr)

    claim("with warmup (DDP and DeepSpeed), while the rate is below half its full value the gradient norm stays "
          "below a tenth of that spike", calm(ddp) < spike / 10 and calm(ds) < spike / 10,
          measured=f"largest {calm(ddp):.1f} and {calm(ds):.1f} vs {spike:.1f}")

    def peak(curve):
        k = max(range(len(curve["grad_norm"])), key=curve["grad_norm"].__getitem__)
        return k, curve["grad_norm"][k], curve["lr"][k]

    (k_ddp, n_ddp, lr_ddp), (k_ds, n_ds, lr_ds) = peak(ddp), peak(ds)
    claim("with warmup, each run's largest gradient norm comes at a step whose rate is at least half the full one: "
          "the too-high rate still shows, later", lr_ddp >= HALF * lr and lr_ds >= HALF * lr,
          measured=f"DDP step {k_ddp} (rate {lr_ddp:.4f}, norm {n_ddp:.1f}), DeepSpeed step {k_ds} "
                   f"(rate {lr_ds:.4f}, norm {n_ds:.1f})")
    claim("... but that spike stays below the one without warmup, in gradient norm and in loss",
          max(n_ddp, n_ds) < spike and max(max(ddp["loss"]), max(ds["loss"])) < max(loss_plain),
          measured=f"largest loss {max(ddp['loss']):.2f} / {max(ds['loss']):.2f} vs {max(loss_plain):.2f} without")
    claim("with warmup, the last 10 steps average a lower loss than without", _tail(ddp["loss"]) < _tail(loss_plain))
    claim("the DeepSpeed run with warmup also ends below the run without", _tail(ds["loss"]) < _tail(loss_plain))
    return {"spike": spike, "peak_ddp": (k_ddp, n_ddp, lr_ddp), "peak_ds": (k_ds, n_ds, lr_ds)}


# --------------------------------------------------------------------------------------------- 4. mixed precision


def _per_param(run) -> dict:
    states = run.result["model_state_bytes"]
    return {k: states[k] / run.result["params"] for k in ("params", "grads", "optimizer", "total")}


def whole_grads_overlapping(sizes: list[int], rank: int, nproc: int, bytes_per: int = 2) -> int:
    """Bytes of the whole gradients (``bytes_per`` each element) of every tensor of ``sizes`` (elements, in order)
    that overlaps ``rank``'s 1/``nproc`` of the flat buffer: what a ZeRO-2 rank holds at the snapshot."""
    part, start, held = math.ceil(sum(sizes) / nproc), 0, 0
    for s in sizes:
        held += bytes_per * s if start < (rank + 1) * part and start + s > rank * part else 0
        start += s
    return held


def claim_precision(fp32, bf16, zero2, nproc: int) -> None:
    """Section 4's bytes per parameter: autocast keeps fp32's 16; a ZeRO-2 bf16 rank holds 2 + g + 12/N, g the
    whole bf16 gradients of the tensors its partition overlaps (SimpleCNN's fc1.weight straddles the cut)."""
    from ...rank.models import SimpleCNN

    for label, run in (("DDP fp32", fp32), ("DDP bf16 autocast", bf16), ("DeepSpeed ZeRO-2 bf16", zero2)):
        b = _per_param(run)
        print(f"{label:22s} bytes per parameter: weights {b['params']:.1f}, gradients {b['grads']:.1f}, "
              f"optimizer {b['optimizer']:.1f}, total {b['total']:.1f}")
    claim("autocast keeps 16 bytes of model state per parameter, as fp32 does",
          round(_per_param(bf16)["total"]) == round(_per_param(fp32)["total"]) == 16)
    named = [(name, p.numel()) for name, p in SimpleCNN(10).named_parameters()]
    sizes, (big, big_n) = [n for _, n in named], max(named, key=lambda x: x[1])
    print(f"largest tensor of SimpleCNN: {big}, {big_n / sum(sizes):.0%} of its parameters")
    ranks, P = zero2.results_by_rank(), zero2.result["params"]
    g = {k: whole_grads_overlapping(sizes, k, nproc) for k in ranks}
    held = {k: r["model_state_bytes"] for k, r in sorted(ranks.items())}
    claim("each ZeRO-2 rank's gradients are the whole bf16 gradients of the tensors overlapping its partition "
          "(within 1%)", all(abs(h["grads"] - g[k]) <= 0.01 * g[k] for k, h in held.items()),
          measured=", ".join(f"rank {k} {h['grads'] / P:.2f} B/param" for k, h in held.items()))
    claim("each ZeRO-2 rank's total is 2 (bf16 weights) + those gradients + 12/N (fp32 master copy, m, v) bytes per "
          "parameter (within 1%)",
          all(abs(h["total"] - (2 * P + g[k] + 12 * P / nproc)) <= 0.01 * h["total"] for k, h in held.items()),
          measured=", ".join(f"rank {k} {h['total'] / P:.2f}" for k, h in held.items())
                   + f" B/param; the paper's 2 + 14/N = {2 + 14 / nproc:.2f}")


def show_precision_cost(fp32, bf16) -> None:
    """Seconds per step (median and min-max of windows inside each run) and peak memory of the MLP pair."""
    spans = {}
    for label, run in (("fp32", fp32), ("bf16 autocast", bf16)):
        spans[label] = med, lo, hi = window_step_s(run, MLP_SKIP, MLP_WINDOWS)
        gpu = _on_gpu(run)
        peak = max(r["cuda_peak_mib" if gpu else "rss_mib"] for r in metrics.steps(run.metrics, 0))
        print(f"DDP {label:14s} {med:.3f} s per step ({lo:.3f}-{hi:.3f}, {MLP_WINDOWS} windows) | "
              f"peak {'GPU memory' if gpu else 'RSS'} {peak:.0f} MiB | final loss {_field(run, 'loss')[-1]:.4f}")
    print(_overlap(spans["fp32"], spans["bf16 autocast"]))


def _overlap(a, b) -> str:
    apart = b[1] > a[2] or b[2] < a[1]
    return ("the two spreads do not overlap: the difference is larger than the noise here" if apart
            else "the two spreads overlap: the difference is within the noise here")


# --------------------------------------------------------------------------------------------- 5. accumulation


def ddp_buckets(model) -> list[list[int]]:
    """The parameter indices of each gradient bucket DDP builds for ``model`` with its defaults: gradients in
    reverse order, the first bucket capped at 1 MiB (``dist._DEFAULT_FIRST_BUCKET_BYTES``), the others at
    ``bucket_cap_mb`` = 25 (``torch.distributed._compute_bucket_assignment_by_size``, DDP's own assignment)."""
    import torch.distributed as dist

    params = list(reversed(list(model.parameters())))
    buckets, _ = dist._compute_bucket_assignment_by_size(params, [dist._DEFAULT_FIRST_BUCKET_BYTES, 25 * 2**20],
                                                         [False] * len(params))
    return buckets


def claim_accumulation(check, nproc: int) -> None:
    """Section 5's check lines: same gradient, same traffic as one big batch, one all-reduce per DDP bucket, and
    (on more than one rank) a faster accumulated step with no_sync()."""
    from ...rank.models import SimpleCNN

    res = check.results_by_rank()
    r0, comm = res[0], res[0]["comm"]
    floor = max([r["fp32_floor"] for r in res.values()] + [parity.FP32_EPS * r0["grad_max_abs"]])  # vs the fp64 twin
    tol = parity.K * floor
    print(f"{r0['micro_batches']} micro batches of {r0['micro_batch']} = one batch of "
          f"{r0['micro_batches'] * r0['micro_batch']} per rank, global batch {r0['global_batch']}")
    claim(f"with no_sync(): the same gradient as the big batch on every rank (within {parity.K} x the fp32 floor, "
          "the big batch's distance from its fp64 twin)",
          all(r["no_sync_max_abs_diff"] <= tol for r in res.values()))
    claim("all-reducing every micro batch gives it too", all(r["every_step_max_abs_diff"] <= tol for r in res.values()))
    for way, c in comm.items():
        print(f"  {way:10s}: {c['calls']} all-reduce calls, {c['bytes'] / 2**20:.2f} MiB handed to all-reduce")
    traffic = lambda way: (comm[way]["calls"], comm[way]["bytes"])  # noqa: E731
    claim("no_sync() communicates exactly what one big batch does", traffic("no_sync") == traffic("big batch"))
    claim("without it, accumulation all-reduces N times the bytes",
          comm["every step"]["bytes"] == r0["micro_batches"] * comm["big batch"]["bytes"])
    buckets = ddp_buckets(SimpleCNN(10))
    claim("one backward makes one all-reduce per DDP bucket: SimpleCNN's gradients fill "
          f"{len(buckets)}, the first capped at 1 MiB", comm["big batch"]["calls"] == len(buckets),
          measured=f"{comm['big batch']['calls']} calls")
    ratio = comm["no_sync"]["seconds"] / comm["every step"]["seconds"]
    if nproc > 1:
        claim("no_sync() makes the accumulated step faster: its median is below that of all-reducing every micro "
              "batch (ratio < 1.0)", ratio < 1.0, measured=f"{ratio:.2f}x")
    else:  # one rank: an all-reduce moves nothing, so there is nothing to save
        print(f"one rank: no_sync / every step = {ratio:.2f}x (nothing is communicated either way)")


def show_accumulation_timing(check) -> None:
    """Rank 0's seconds for the whole accumulated step, each way: median and min-max of the repeats."""
    r0 = check.results_by_rank()[0]
    print(f"seconds for the whole accumulated step, rank 0, median of {r0['repeats']} (min-max):")
    for way, c in r0["comm"].items():
        print(f"  {way:10s} {c['seconds']:.3f} s ({c['seconds_min']:.3f}-{c['seconds_max']:.3f})")
    apart = r0["comm"]["no_sync"]["seconds_max"] < r0["comm"]["every step"]["seconds_min"]
    print(f"no_sync's and every step's spreads {'do not overlap' if apart else 'overlap'} here")


# --------------------------------------------------------------------------------------------- 6. torch.compile


def show_compile(eager, compiled):
    """First step and steady-state seconds per step (median, min-max of windows) of an eager and a compiled run of
    the same flags; a log-scale plot of both (the first compiled step is a hundred later ones)."""
    spans = {}
    for label, run in (("eager", eager), ("compiled", compiled)):
        spans[label] = med, lo, hi = window_step_s(run, CNN_SKIP, CNN_WINDOWS)
        print(f"{label:9s} first step {_field(run, 'step_s')[0]:6.2f} s | later steps {med:.4f} s per step "
              f"({lo:.4f}-{hi:.4f}, {CNN_WINDOWS} windows after the first {CNN_SKIP} steps)")
    print(f"compiled / eager, later steps: {spans['compiled'][0] / spans['eager'][0]:.2f}x; "
          + _overlap(spans["eager"], spans["compiled"]))
    fig = plots.curves({"eager": eager.metrics, "torch.compile": compiled.metrics}, "step_s", logy=True,
                       title="seconds per optimizer step, eager vs compiled (rank 0)")
    fig.axes[0].set_ylabel("seconds per step (log scale)")
    return fig


def claim_compile(eager, compiled, eager64) -> None:
    """Section 6's check lines: the same losses (within :data:`parity.K` floors; ``eager64``: the eager run's fp64
    twin, its first steps), and compilation's cost on the first step."""
    loss_e, loss_c = _field(eager, "loss"), _field(compiled, "loss")
    floor = parity.floor(loss_e[:10], _field(eager64, "loss")[:10])
    same = parity.check(loss_c[:10], loss_e[:10], floor)
    claim(f"compiled and eager losses agree for the first 10 steps (within {parity.K} x the fp32 floor, measured "
          "against the eager run's fp64 twin)", same["ok"], measured=parity.describe(same))
    step_c = _field(compiled, "step_s")
    claim("the compiled run's first step (tracing and code generation) is its slowest", step_c[0] == max(step_c))
    cost = step_c[0] / window_step_s(eager, CNN_SKIP, CNN_WINDOWS)[0]
    claim("the first compiled step costs more than 20 eager steps", cost > 20, measured=f"{cost:.0f} eager steps")
