"""Notebook 05 (tuning): the warmup checks of section 3, phrased so that they hold at every value the parameters cell
offers (1-4 ranks, either profile, generated data or CIFAR-10).

Three runs of SimpleCNN with AdamW at a rate ten times a usual one: without warmup, with ``LambdaLR`` warmup (DDP)
and with DeepSpeed's ``WarmupLR`` (ZeRO-2, bf16). What holds however the batches fall:

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

from ...calc import schedules
from ...rank import metrics
from ..checks import claim

HALF = 0.5  # "a high rate": at least this fraction of the full one ("half" in the claims)


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
    claim("the DeepSpeed bf16 run with warmup also ends below the run without", _tail(ds["loss"]) < _tail(loss_plain))
    return {"spike": spike, "peak_ddp": (k_ddp, n_ddp, lr_ddp), "peak_ds": (k_ds, n_ds, lr_ds)}
