"""Matplotlib figures the notebooks show. Each takes records read from a run directory."""
from __future__ import annotations

from . import metrics as _metrics


def _plt():
    import matplotlib.pyplot as plt
    return plt


def bandwidth(records: list[dict], title: str | None = None):
    """Bus and algorithm bandwidth of an all-reduce sweep (``course/allreduce_bench.py``) against message size."""
    plt = _plt()
    rows = _metrics.steps(records, rank=0)
    sizes = [r["size_bytes"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    ax.plot(sizes, [r["busbw_gbs"] for r in rows], "o-", label="bus bandwidth (busbw)")
    ax.plot(sizes, [r["algbw_gbs"] for r in rows], "s--", alpha=0.7, label="algorithm bandwidth (algbw)")
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
    ax.set_xlabel("step")
    ax.set_ylabel(field)
    ax.set_title(title or f"{field} per step, every rank")
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
    gpu = all("peak_cuda_mb" in results_by_world[n] for n in worlds)
    mems = [results_by_world[n]["peak_cuda_mb" if gpu else "peak_rss_mb"] for n in worlds]
    fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3.2))
    a.bar(labels, rates, color="tab:blue")
    a.set_ylabel("samples/s (all ranks)")
    a.set_title("throughput")
    b.bar(labels, mems, color="tab:orange")
    b.set_ylabel("MB per rank")
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
    bytes), as built in notebook 03 from ``helpers.memory.compare_to_formula``; the rank holding most is shown."""
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
