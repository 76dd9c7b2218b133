"""One row per run for the comparison and tuning chapters (notebooks 04 and 05), read from what the ranks reported.

* :func:`comm_per_step` -- what the counted collectives of a run send per rank and optimizer step
  (:func:`helpers.calc.comm.bytes_sent_per_rank` applied to each).
* :func:`summary` and :func:`table` -- one row per run (memory, speed, communication, loss, checkpoint size) and
  its text table; :data:`COLUMNS` are the table's default columns.

Example::

    from helpers.notebook import results
    print(results.table([results.summary(ddp, "DDP"), results.summary(z3, "ZeRO-3")]))
"""
from __future__ import annotations

from typing import Mapping

from ..calc.comm import bytes_sent_per_rank

MIB = 2**20


# --------------------------------------------------------------------------------------------- notebook side


def comm_per_step(run) -> dict:
    """``{collective: {"calls", "bytes", "sent_bytes"}}`` per optimizer step of rank 0, plus ``"total_sent_bytes"``.

    Needs a run of ``course/ddp_tuning.py`` (counted by a DDP communication hook unless ``--no-count-comms``) or of
    ``course/ds_tuning.py --count-comms`` (DeepSpeed's comms_logger); ``sent_bytes`` is
    :func:`bytes_sent_per_rank` applied to each collective.
    """
    result = run.result
    ops = result.get("comm_per_step") or {}
    n = result.get("world_size", run.nproc)
    out = {op: dict(v, sent_bytes=bytes_sent_per_rank(op, v["bytes"], n)) for op, v in ops.items()}
    out["total_sent_bytes"] = sum(v["sent_bytes"] for v in out.values())
    return out


def summary(run, label: str | None = None) -> dict:
    """One row about a ``course/ddp_tuning.py`` or ``course/ds_tuning.py`` run: what notebooks 04 and 05 compare.

    Keys (memory in MiB, field meanings in :class:`helpers.rank.metrics.TrainStep` / ``TrainResult``): ``label``,
    ``framework``, ``stage``, ``offload``, ``dtype``, ``params``, ``model_states_mib`` (rank 0, measured),
    ``model_states_mib_by_rank``, ``rss_start_mib`` (rank 0 before the model existed: the framework's own share),
    ``max_rss_mib`` (rank 0's highest RSS sampled at the end of a step), ``max_rss_mib_by_rank``,
    ``cuda_peak_mib`` (GPU runs, rank 0's CUDA high-water mark), ``samples_per_s`` (all ranks, steps after the
    first), ``first_step_s``, ``final_loss`` (rank 0's last step), ``checkpoint_mib``, ``comm_mib_per_step``
    (what rank 0 sends per optimizer step, :func:`comm_per_step`).

    Example::

        summary(launch.torchrun("course/ddp_tuning.py", nproc=2, args=["--steps", "5"]), "DDP")
    """
    from ..rank import metrics

    result = run.result
    by_rank = run.results_by_rank()
    steps = metrics.steps(run.metrics)
    last = metrics.steps(run.metrics, rank=0)[-1]
    row = {
        "label": label or result.get("framework", "?"),
        "framework": result.get("framework"),
        "stage": result.get("zero_stage"),
        "offload": result.get("offload"),
        "dtype": result.get("dtype"),
        "params": result.get("params"),
        "model_states_mib": result["model_state_bytes"]["total"] / MIB,
        "model_states_mib_by_rank": {r: v["model_state_bytes"]["total"] / MIB for r, v in by_rank.items()
                                     if "model_state_bytes" in v},
        "rss_start_mib": result.get("rss_start_mib"),
        "max_rss_mib": max(s["rss_mib"] for s in steps if s["rank"] == 0),
        "max_rss_mib_by_rank": {r: max(s["rss_mib"] for s in steps if s["rank"] == r)
                                for r in sorted({s["rank"] for s in steps})},
        "samples_per_s": result.get("samples_per_s"),
        "first_step_s": result.get("first_step_s"),
        "final_loss": last["loss"],
        "checkpoint_mib": result["checkpoint_bytes"] / MIB if result.get("checkpoint_bytes") is not None else None,
        "comm_mib_per_step": (comm_per_step(run)["total_sent_bytes"] / MIB) if result.get("comm_per_step") else None,
    }
    if any("cuda_peak_mib" in s for s in steps):
        row["cuda_peak_mib"] = max(s.get("cuda_peak_mib", 0.0) for s in steps if s["rank"] == 0)
    return row


COLUMNS = (("label", "run", "{}"), ("model_states_mib", "model states MiB/rank", "{:.0f}"),
           ("cuda_peak_mib", "peak GPU MiB/rank", "{:.0f}"), ("max_rss_mib", "max RSS MiB/rank", "{:.0f}"),
           ("rss_start_mib", "RSS before model MiB", "{:.0f}"), ("samples_per_s", "samples/s", "{:.0f}"),
           ("comm_mib_per_step", "sent MiB/step/rank", "{:.0f}"), ("final_loss", "final loss", "{:.4f}"),
           ("checkpoint_mib", "checkpoint MiB", "{:.0f}"))


def table(rows: list[Mapping], columns: tuple = COLUMNS) -> str:
    """A plain-text table of :func:`summary` rows (columns absent from every row are left out).

    Example::

        print(table([summary(ddp, "DDP"), summary(z3, "ZeRO-3")]))
    """
    cols = [c for c in columns if any(r.get(c[0]) is not None for r in rows)]
    cells = [[title for _, title, _ in cols]]
    for r in rows:
        cells.append([fmt.format(r[key]) if r.get(key) is not None else "-" for key, _, fmt in cols])
    widths = [max(len(line[i]) for line in cells) for i in range(len(cols))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
             for line in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
