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


def comparison(rows: list[dict], title: str | None = None, speed: dict | None = None):
    """Four panels for runs of the same model and data (rows of :func:`helpers.notebook.results.summary`): memory per
    rank (model states measured and peak process or GPU memory), samples/s, bytes sent per step, checkpoint size.

    ``speed``: ``{label: {"median", "min", "max", "windows"}}`` (:func:`helpers.notebook.lessons.comparison.speeds`):
    the samples/s bars are the medians with the min-max as an error bar, and a row without an entry says "not timed"
    instead of showing a zero. Without it, each row's own ``samples_per_s``."""
    plt = _plt()
    labels = [r["label"] for r in rows]
    x = list(range(len(rows)))
    gpu = all(r.get("cuda_peak_mib") is not None for r in rows)
    peak_key, peak_name = ("cuda_peak_mib", "peak GPU memory") if gpu else ("max_rss_mib", "max RSS (process)")
    fig, axes = plt.subplots(2, 2, figsize=(10, 6.4))
    mem, rate, comm, ckpt = axes[0][0], axes[0][1], axes[1][0], axes[1][1]
    width = 0.38
    for shift, key, name, color in ((-width / 2, "model_states_mib", "model states (measured)", "tab:green"),
                                    (width / 2, peak_key, peak_name, "tab:gray")):
        values = [r[key] for r in rows]
        mem.bar([i + shift for i in x], values, width, label=name, color=color)
        for i, v in enumerate(values):
            mem.annotate(f"{v:.0f}", (i + shift, v), ha="center", va="bottom", fontsize=7)
    mem.set(title="memory per rank (rank 0)", ylabel="MiB")
    mem.legend(fontsize=8, loc="upper left", ncol=2, frameon=False)
    if speed is None:
        speed = {r["label"]: {"median": r["samples_per_s"], "min": r["samples_per_s"], "max": r["samples_per_s"]}
                 for r in rows if r.get("samples_per_s")}
    timed = [i for i, l in enumerate(labels) if l in speed]
    med = [speed[labels[i]]["median"] for i in timed]
    err = [[m - speed[labels[i]]["min"] for i, m in zip(timed, med)],
           [speed[labels[i]]["max"] - m for i, m in zip(timed, med)]]
    rate.bar(timed, med, color="tab:blue", yerr=err, capsize=4)
    windows = {len(s.get("windows", ())) for s in speed.values()}
    rate.set(title="throughput: median, min-max" + (f" of {windows.pop()} windows" if len(windows) == 1 else ""),
             ylabel="samples/s (all ranks)")
    for i, m in zip(timed, med):
        rate.annotate(f"{m:.0f}", (i, speed[labels[i]]["max"]), ha="center", va="bottom", fontsize=8)
    for i in (i for i in x if i not in timed):
        rate.annotate("not\ntimed", (i, 0), ha="center", va="bottom", fontsize=8, color="dimgray")
    for ax, key, name, ylabel, color in ((comm, "comm_mib_per_step", "communication", "MiB sent per step per rank",
                                          "tab:purple"),
                                         (ckpt, "checkpoint_mib", "checkpoint size", "MiB on disk", "tab:orange")):
        values = [r.get(key) or 0.0 for r in rows]
        ax.bar(x, values, color=color)
        ax.set(title=name, ylabel=ylabel)
        for i, v in enumerate(values):
            ax.annotate(f"{v:.0f}", (i, v), ha="center", va="bottom", fontsize=8)
        if not any(values):  # one rank: nothing to send; say so rather than leave an empty panel
            ax.text(0.5, 0.5, "nothing sent: one rank", transform=ax.transAxes, ha="center", color="dimgray")
            ax.set_yticks([])
    for ax in (mem, rate, comm, ckpt):
        ax.set_xticks(x)
        ax.set_xticklabels(labels, rotation=15, fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
        top = ax.get_ylim()[1]
        ax.set_ylim(0, top * (1.3 if ax is mem else 1.12))  # head room for the value labels (and the legend)
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
