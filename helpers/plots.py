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
