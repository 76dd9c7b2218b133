"""Matplotlib figures the notebooks show. Each takes records read from a run directory."""
from __future__ import annotations

from ..rank import metrics as _metrics


def _plt():
    import matplotlib.pyplot as plt
    return plt


def bandwidth(records: list[dict], title: str | None = None):
    """Bus and algorithm bandwidth of an all-reduce sweep (``course/allreduce_bench.py``) against message size."""
    plt = _plt()
    rows = _metrics.steps(records, rank=0)
    sizes = [r["size_bytes"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    bus, alg = [r["busbw_gbs"] for r in rows], [r["algbw_gbs"] for r in rows]
    if bus == alg:  # 2 ranks: 2(n-1)/n = 1, the two lines would lie on top of each other
        ax.plot(sizes, alg, "o-", label="algbw = busbw (2 ranks: 2(n-1)/n = 1)")
    else:
        ax.plot(sizes, bus, "o-", label="bus bandwidth (busbw)")
        ax.plot(sizes, alg, "s--", alpha=0.7, label="algorithm bandwidth (algbw)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("GB/s")
    ax.set_title(title or "all-reduce bandwidth by message size")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def loss_per_rank(records: list[dict], field: str = "loss", title: str | None = None):
    """One line per rank of a per-step field (loss by default)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    ranks = sorted({r["rank"] for r in _metrics.steps(records)})
    for rank in ranks:
        xs, ys = _metrics.series(records, field, rank)
        ax.plot(xs, ys, label=f"rank {rank}", alpha=0.8)
    words = {"loss": "training loss (cross-entropy)"}.get(field, field)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(words)
    ax.set_title(title or f"{words} per step, every rank")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def scaling(results_by_world: dict[int, dict], title: str | None = None):
    """Samples/s and peak memory per rank side by side for runs of different world sizes.

    ``results_by_world`` maps world size -> ``Run.result`` of ``course/ddp_cifar10.py``."""
    plt = _plt()
    worlds = sorted(results_by_world)
    labels = [f"{n} rank{'s' if n > 1 else ''}" for n in worlds]
    rates = [results_by_world[n]["samples_per_s"] for n in worlds]
    gpu = all("cuda_peak_mib" in results_by_world[n] for n in worlds)
    mems = [results_by_world[n]["cuda_peak_mib" if gpu else "peak_rss_mib"] for n in worlds]
    fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3.2))
    a.bar(labels, rates, color="tab:blue")
    a.set_ylabel("samples/s (all ranks)")
    a.set_title("throughput")
    b.bar(labels, mems, color="tab:orange")
    b.set_ylabel("MiB per rank")
    b.set_title("peak GPU memory" if gpu else "peak process memory (RSS)")
    for ax, values in ((a, rates), (b, mems)):
        for i, v in enumerate(values):
            ax.annotate(f"{v:.0f}", (i, v), ha="center", va="bottom")
    fig.suptitle(title or "same data and global batch, different world sizes")
    fig.tight_layout()
    return fig


def memory_by_stage(rows: list[dict], title: str | None = None):
    """Stacked bars of model-state bytes per rank, measured next to the formula, for each ZeRO stage.

    ``rows``: dicts with ``stage``, ``rank``, ``measured`` and ``formula`` (each ``{params, grads, optimizer}``
    bytes), as built in notebook 03 from ``helpers.calc.memory.compare_to_formula``; the rank holding most is shown."""
    plt = _plt()
    stages = sorted({r["stage"] for r in rows})
    worst = {s: max((r for r in rows if r["stage"] == s), key=lambda r: r["measured"]["total"]) for s in stages}
    parts = (("params", "tab:blue"), ("grads", "tab:orange"), ("optimizer", "tab:green"))
    fig, ax = plt.subplots(figsize=(7, 3.8))
    width = 0.38
    for offset, source, hatch in ((-width / 2, "measured", ""), (width / 2, "formula", "//")):
        bottom = [0.0] * len(stages)
        for part, colour in parts:
            values = [worst[s][source][part] / 2**20 for s in stages]
            ax.bar([i + offset for i in range(len(stages))], values, width, bottom=bottom, color=colour,
                   hatch=hatch, edgecolor="white", label=f"{part} ({source})")
            bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xticks(range(len(stages)), [f"ZeRO-{s}" for s in stages])
    ax.set_ylabel("MiB per rank")
    ax.set_title(title or "model states per rank: measured (solid) vs formula (hatched)")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def comparison(rows: list[dict], title: str | None = None):
    """Four panels for runs of the same model and data (rows of :func:`helpers.notebook.results.summary`): memory per rank
    (model states measured and peak process or GPU memory), samples/s, bytes sent per step, checkpoint size."""
    plt = _plt()
    labels = [r["label"] for r in rows]
    x = list(range(len(rows)))
    gpu = all(r.get("cuda_peak_mib") is not None for r in rows)
    peak_key, peak_name = ("cuda_peak_mib", "peak GPU memory") if gpu else ("max_rss_mib", "max RSS")
    fig, axes = plt.subplots(2, 2, figsize=(10, 6.4))
    mem = axes[0][0]
    width = 0.38
    states = [r["model_states_mib"] for r in rows]
    peaks = [r[peak_key] for r in rows]
    mem.bar([i - width / 2 for i in x], states, width, label="model states (measured)", color="tab:green")
    mem.bar([i + width / 2 for i in x], peaks, width, label=peak_name, color="tab:gray")
    mem.set_ylabel("MiB per rank (rank 0)")
    mem.set_title("memory per rank")
    mem.legend(fontsize=8)
    panels = ((axes[0][1], "samples_per_s", "samples/s (all ranks)", "throughput", "tab:blue"),
              (axes[1][0], "comm_mib_per_step", "MiB sent per step per rank", "communication", "tab:purple"),
              (axes[1][1], "checkpoint_mib", "MiB on disk", "checkpoint size", "tab:orange"))
    for ax, key, ylabel, name, color in panels:
        values = [r.get(key) or 0.0 for r in rows]
        ax.bar(x, values, color=color)
        ax.set_ylabel(ylabel)
        ax.set_title(name)
        for i, v in enumerate(values):
            ax.annotate(f"{v:.0f}", (i, v), ha="center", va="bottom", fontsize=8)
    for i, (s, p) in enumerate(zip(states, peaks)):
        mem.annotate(f"{s:.0f}", (i - width / 2, s), ha="center", va="bottom", fontsize=8)
        mem.annotate(f"{p:.0f}", (i + width / 2, p), ha="center", va="bottom", fontsize=8)
    for ax in (a for row in axes for a in row):
        ax.set_xticks(x)
        ax.set_xticklabels(labels, rotation=20, fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(title or "same model, data, global batch, seed and steps")
    fig.tight_layout()
    return fig


def curves(runs: dict, field: str = "loss", rank: int = 0, title: str | None = None, logy: bool = False, ax=None):
    """One line per run of a per-step field of one rank. ``runs`` maps a label to a run's records (``Run.metrics``).

    Pass ``ax`` to draw into an existing panel (the figure is returned either way)."""
    plt = _plt()
    fig = None
    if ax is None:
        fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for label, records in runs.items():
        xs, ys = _metrics.series(records, field, rank)
        ax.plot(xs, ys, label=label, alpha=0.85)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(field)
    if logy:
        ax.set_yscale("log")
    ax.set_title(title or f"{field} per step (rank {rank})")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    if fig is not None:
        fig.tight_layout()
    return fig or ax.figure
