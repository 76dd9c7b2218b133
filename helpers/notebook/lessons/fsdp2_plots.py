"""Notebook 07's two figures (:mod:`helpers.notebook.lessons.fsdp2` re-exports them, so a cell calls
``lesson.plot_losses``): the loss curves across the resharded resume, and the five panels comparing DDP,
DeepSpeed ZeRO-3 and FSDP2 (model states, peak memory, samples/s, bytes sent, checkpoint size).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .fsdp2 import Settings


def plot_losses(curves: dict, cfg: Settings):
    """The one-process curve, the three systems on ``nproc`` ranks and the resumed run, per optimizer step."""
    import matplotlib.pyplot as plt

    n, s = cfg.nproc, cfg.steps
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    ax.plot(range(1, 2 * s + 1), curves["one process"], color="grey", lw=3, alpha=0.5, label="FSDP2, 1 process")
    ax.plot(range(1, s + 1), curves["FSDP2"], "o-", ms=3, label=f"FSDP2, {n} ranks (saved at step {s})")
    ax.plot(range(s + 1, 2 * s + 1), curves["resumed"], "s-", ms=3, label=f"FSDP2, resumed on {cfg.resume_nproc} ranks")
    ax.plot(range(1, s + 1), curves["ZeRO-3"], "x", label=f"DeepSpeed ZeRO-3, {n} ranks")
    ax.plot(range(1, s + 1), curves["DDP"], "+", ms=8, label=f"DDP, {n} ranks")
    ax.set(xlabel="optimizer step", ylabel="loss of the global batch (mean of ranks)",
           title="same global batches, same losses, across a resharded resume")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_comparison(rows: list[dict], speed: dict, cfg: Settings):
    """Five panels: model states (measured, and the formula) on their own axis, peak process or GPU memory,
    samples/s with the windows' min-max, bytes sent per step, checkpoint size."""
    import matplotlib.pyplot as plt

    labels = [r["label"] for r in rows]
    x = list(range(len(rows)))
    gpu = all(r.get("cuda_peak_mib") is not None for r in rows)
    peak_key, peak_name = ("cuda_peak_mib", "peak GPU memory") if gpu else ("max_rss_mib", "max RSS (process)")
    fig, axes = plt.subplots(1, 5, figsize=(15, 3.6))
    states = axes[0]  # its own axis: beside process memory (hundreds of MiB) a few MiB of states would not show
    for shift, key, color, name in ((-0.2, "model_states_mib", "tab:green", "measured"),
                                    (0.2, "formula_mib", "tab:olive", "formula")):
        values = [r[key] for r in rows]
        states.bar([i + shift for i in x], values, 0.4, color=color, label=name)
        for i, v in enumerate(values):
            states.annotate(f"{v:.2f}", (i + shift, v), ha="center", va="bottom", fontsize=7)
    states.set(title="model states per rank", ylabel="MiB (rank 0)")
    states.legend(fontsize=8, loc="lower left")
    rates = [r["samples_per_s"] for r in rows]
    err = [[r - speed[l][1] for r, l in zip(rates, labels)], [speed[l][2] - r for r, l in zip(rates, labels)]]
    panels = ((axes[1], [r[peak_key] for r in rows], peak_name + " per rank", "MiB (rank 0)", "tab:gray", None),
              (axes[2], rates, f"samples/s (median of {cfg.windows} windows)", "samples/s", "tab:blue", err),
              (axes[3], [r.get("comm_mib_per_step") or 0.0 for r in rows], "sent per step per rank", "MiB",
               "tab:purple", None),
              (axes[4], [r.get("checkpoint_mib") or 0.0 for r in rows], "checkpoint size", "MiB", "tab:orange", None))
    for ax, values, title, ylabel, color, yerr in panels:
        ax.bar(x, values, color=color, yerr=yerr, capsize=4)
        ax.set(title=title, ylabel=ylabel)
        for i, v in enumerate(values):  # above the error bar, where there is one
            ax.annotate(f"{v:.1f}" if v < 10 else f"{v:.0f}", (i, v + (yerr[1][i] if yerr else 0)), ha="center",
                        va="bottom", fontsize=8)
    for ax in axes:
        ax.set_xticks(x)
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.15)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"DDP vs DeepSpeed ZeRO-3 vs FSDP2: SimpleCNN, {cfg.nproc} ranks, same data and steps")
    fig.tight_layout()
    return fig
