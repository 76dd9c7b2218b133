"""Notebook 10, section 8: choosing a layout. The configuration guide (:mod:`helpers.calc.plan`) on published models'
scenarios, held against the memory each rank of the DP x PP x TP run measured, and priced with this machine's
bandwidth (notebook 00's) against an H100 node's. :mod:`.pipeline` re-exports these names: the notebook calls them
as ``lesson.show_proposals()`` and the like.
"""
from __future__ import annotations

import re

from ...rank import metrics
from ..checks import claim
from ..i18n import _
from ..scripts import COURSE
from .table import Lines, columns, line, show


def gpt_shape(gpt: dict) -> dict:
    """The shape :mod:`helpers.calc.plan` reads, from a run's reported ``gpt`` (GPTConfig.as_dict())."""
    return dict(vocab=gpt["vocab_size"], seq_len=gpt["seq_len"], n_layer=gpt["n_layer"], n_head=gpt["n_head"],
                d_model=gpt["d_model"], attention=gpt.get("attention", "math"))


# ---------------------------------------------------------------------------------------- 8. choosing a layout

GB = 1e9
GIB = 2 ** 30
GPU_BYTES = 80 * GIB  # an H100 SXM's 80 GB (GiB as the CUDA allocator counts)
GPUS_PER_NODE = 8
# GPT-3's family (Brown et al. 2020, arXiv:2005.14165, Table 2.1): layers, width, heads, and the batch in sequences of
# 2048 tokens (0.5M, 1M and 3.2M tokens); 13B's width rounded from 5140 to 5120 so that its 40 heads divide it
SCENARIOS = (
    ("GPT-3 XL 1.3B", dict(vocab=50257, seq_len=2048, n_layer=24, n_head=16, d_model=2048, attention="sdpa"), 8, 512),
    ("GPT-3 13B", dict(vocab=50257, seq_len=2048, n_layer=40, n_head=40, d_model=5120, attention="sdpa"), 64, 1024),
    ("GPT-3 175B", dict(vocab=50257, seq_len=2048, n_layer=96, n_head=96, d_model=12288, attention="sdpa"), 1024,
     1536),
)
MEGATRON_175B = dict(dp=16, tp=8, pp=8, microbatches=96)  # TP inside a node, PP across nodes, DP outermost
MODEL_TIE = 0.02  # step times this close are a tie for a first-order model that leaves out PP's sends and imbalance


def _layout(l: dict) -> str:
    mesh = f"dp {l['dp']} x tp {l['tp']} x pp {l['pp']}, ZeRO-{l['zero']}"
    if l["sp"]:
        return _("{mesh}, checkpoint {checkpoint}, sequence parallel, {m} micro-batches", mesh=mesh,
                 checkpoint=l["checkpoint"], m=l["microbatches"])
    return _("{mesh}, checkpoint {checkpoint}, {m} micro-batches", mesh=mesh, checkpoint=l["checkpoint"],
             m=l["microbatches"])


def _row(tag, f: dict) -> list:
    """A layout's two lines: its tag (a text, or a list of pieces) and shape, then its memory and modelled step
    time."""
    t = f["seconds"]
    return [line("  ", *(tag if isinstance(tag, list) else [tag]), ": ", _layout(f["layout"])),
            line("            ", _("{gib} GiB per GPU, step {total} s (compute {compute}, TP {tp}, exposed DP {dp}, "
                                   "bubble {bubble})", gib=f"{f['bytes'] / GIB:5.1f}", total=f"{t['total']:.2f}",
                                   compute=f"{t['compute']:.2f}", tp=f"{t['tp']:.2f}", dp=f"{t['dp_exposed']:.2f}",
                                   bubble=f"{t['bubble']:.0%}"))]


def show_proposals() -> None:
    """For each scenario: the layout :func:`helpers.calc.plan.propose` puts first, and the best one without model
    parallelism (tp = pp = 1), with memory per GPU and the modelled step time; for 175B also Megatron-LM's layout."""
    from ...calc import plan

    table = [line(_("bf16 weights, fp32 master copy and Adam (K = 12), flash attention, micro-batches of 1 sequence "
                    "(without a pipeline: gradient accumulation); {gib} GiB per GPU, {usable} of it usable, {n} GPUs "
                    "per node", gib=f"{GPU_BYTES / GIB:.0f}", usable=f"{plan.USABLE:.0%}", n=GPUS_PER_NODE))]
    firsts, dp_firsts, megatron = {}, {}, None
    for name, shape, gpus, batch in SCENARIOS:
        fits = plan.propose(shape, gpu_bytes=GPU_BYTES, n_gpus=gpus, gpus_per_node=GPUS_PER_NODE, global_batch=batch)
        dp_only = [f for f in fits if f["layout"]["tp"] == f["layout"]["pp"] == 1]
        firsts[name], dp_firsts[name] = (fits or [None])[0], (dp_only or [None])[0]
        table += [[], line(_("{name} on {gpus} GPUs, {batch} sequences a step: {n} layouts fit", name=name, gpus=gpus,
                             batch=batch, n=len(fits)))]
        table += _row(_("proposed"), fits[0]) if fits else [line("  ", _("proposed"), ": ", _("none fits"))]
        dp_tag = [_("DP only"), " "]
        if not dp_only:
            why = (_("{gpus} ranks do not split {batch} sequences", gpus=gpus, batch=batch) if batch % gpus
                   else _("none fits in memory"))
            table.append(line("  ", *dp_tag, ": ", _("none ({why})", why=why)))
        else:
            table += [line("  ", *dp_tag, ": ", _("the same"))] if dp_only[0] is fits[0] else _row(dp_tag, dp_only[0])
        if name == SCENARIOS[-1][0]:
            lay = MEGATRON_175B
            megatron = next((f for f in fits if all(f["layout"][k] == v for k, v in lay.items())), None)
            table += _row("Megatron", megatron) if megatron else [line("  Megatron: ", _("does not fit"))]
    show(Lines(table))
    xl, mid, large = (scenario[0] for scenario in SCENARIOS)
    total = {k: f["seconds"]["total"] if f else None for k, f in
             dict(xl=firsts[xl], mid=firsts[mid], mid_dp=dp_firsts[mid], large=firsts[large], megatron=megatron).items()}
    claim(f"{xl}: no model parallelism (tp = pp = 1)", bool(firsts[xl]) and firsts[xl]["layout"]["tp"] == 1
          and firsts[xl]["layout"]["pp"] == 1)
    claim(f"{mid}: DP alone leaves part of its once-a-step all-reduce exposed (only the last micro-batch's backward "
          f"hides it), and the proposal, with model parallelism, is faster", bool(dp_firsts[mid] and firsts[mid])
          and dp_firsts[mid]["seconds"]["dp_exposed"] > 0 and total["mid"] < total["mid_dp"]
          and firsts[mid]["layout"]["tp"] * firsts[mid]["layout"]["pp"] > 1,
          measured=f"DP only {total['mid_dp']:.2f} s (exposed DP {dp_firsts[mid]['seconds']['dp_exposed']:.2f}) vs "
                   f"{total['mid']:.2f} s" if dp_firsts[mid] and firsts[mid] else "no layout")
    close = bool(firsts[large] and megatron) and total["megatron"] <= total["large"] * (1 + MODEL_TIE)
    claim(f"{large}: TP over all {GPUS_PER_NODE} GPUs of a node, and Megatron-LM's layout within {MODEL_TIE:.0%} of "
          f"the proposal's modelled step (closer than the model can tell apart)",
          close and firsts[large]["layout"]["tp"] == GPUS_PER_NODE,
          measured=f"{total['megatron']:.2f} vs {total['large']:.2f} s" if close else "no layout")


def predicted_3d(run) -> list[dict]:
    """The calculator's per-stage memory for the layout the 3-D run used (fp32, ZeRO-0: DP by hand)."""
    from ...calc import plan

    r, g = run.result, run.result["gpt"]
    shape = gpt_shape(g)
    m = r["pp_microbatches"]
    return plan.rank_memory(shape, dp=r["dp_degree"], tp=r["tp_degree"], pp=r["pp_degree"], zero=0,
                            checkpoint=g["checkpoint"], micro_batch=r["global_batch"] // r["dp_degree"] // m,
                            microbatches=m, schedule=r["pp_schedule"], precision="fp32", step_counters=True)


def claim_prediction(runs3: dict) -> None:
    """The calculator's per-rank memory against what each of the 8 ranks measured: model states exactly (AdamW's
    step counters included), activations within the formula tolerance of notebook 08."""
    from .activations import FORMULA_TOLERANCE

    predicted = predicted_3d(runs3["3-D"])
    spec = ((4, ">"), (5, ">"), (10, ">"), (8, ">"), (15, ">"), (8, ">"), (6, ">"))
    table = [columns(spec, "rank", _("stage"), _("states KiB"), _("formula"), _("activations KiB"), _("formula"),
                     _("ratio"))]
    exact, ratios = [], []
    for rank, res in runs3["3-D"].results_by_rank().items():
        stage = res["pp_stages"][0]
        want, got = predicted[stage], res["rank_state_bytes"]
        states = sum(got.values())
        act = res["pp_saved_bytes"][str(stage)]
        exact.append(got == {"params": want["params_bytes"], "grads": want["grads"], "optimizer": want["optimizer"]})
        ratios.append(act / want["activations"])
        table.append(columns(spec, str(rank), str(stage), f"{states / 1024:.1f}",
                             f"{(want['total'] - want['activations']) / 1024:.1f}", f"{act / 1024:.1f}",
                             f"{want['activations'] / 1024:.1f}", f"{ratios[-1]:.3f}"))
    show(Lines(table))
    claim("each rank's parameters, gradients and AdamW state are the calculator's bytes exactly", all(exact),
          measured=f"{sum(exact)} of {len(exact)} ranks")
    claim(f"each rank's peak activations (1F1B: min(p - s, m) micro-batches in flight) within 1 +- "
          f"{FORMULA_TOLERANCE} of the calculator's", all(abs(x - 1) <= FORMULA_TOLERANCE for x in ratios),
          measured=f"{min(ratios):.3f} - {max(ratios):.3f}")


def bandwidth_here() -> tuple[float, str] | None:
    """The peak bus bandwidth notebook 00 measured, GB/s, and where it comes from: its newest ``00_bandwidth`` run on
    this machine, else the headline cell of notebook 00's committed outputs ("peak bus bandwidth measured: X GB/s")."""
    from ... import launch

    runs = sorted((launch.runs_root() / "00_bandwidth").glob("*/metrics.jsonl"))
    if runs:
        steps = [r for r in metrics.read_metrics(runs[-1].parent) if r.get("kind") == "step"]
        best = max((r["busbw_gbs"] for r in steps), default=0.0)
        if best > 0:
            return best, _("notebook 00's all-reduce on this machine")
    import nbformat

    nb = nbformat.read(COURSE.parent / "notebooks" / "00_environment_check.ipynb", as_version=4)
    for cell in nb.cells:
        if "headline" in cell.get("metadata", {}).get("tags", []):
            for out in cell.get("outputs", []):
                found = re.search(r"peak bus bandwidth measured: ([0-9.]+) GB/s", out.get("text", ""))
                if found and float(found.group(1)) > 0:
                    return float(found.group(1)), _("notebook 00's committed output, not run on this machine yet")
    return None


def axis_costs() -> tuple[dict, float]:
    """Bytes per step and rank on each axis of GPT-3 175B in Megatron's shape, and the step's modelled compute."""
    from ...calc import plan

    _name, shape, _gpus, batch = SCENARIOS[-1]
    lay = MEGATRON_175B
    comm = plan.step_comm_bytes(shape, dp=lay["dp"], tp=lay["tp"], pp=lay["pp"], microbatches=lay["microbatches"],
                                precision="mixed", vocab_parallel=True)
    full = dict(lay, zero=1, checkpoint="none", sp=True, vocab_parallel=True)
    compute = plan.step_seconds(shape, full, global_batch=batch, micro_batch=1, gpus_per_node=GPUS_PER_NODE)["compute"]
    return comm, compute


def claim_axis_costs() -> None:
    """The table of bytes and seconds per axis over NVLink and InfiniBand, and the claim that TP needs NVLink."""
    from ...calc import plan

    comm, compute = axis_costs()
    lay, links = MEGATRON_175B, {"NVLink": plan.H100_NODE["nvlink"], "InfiniBand": plan.H100_NODE["network"]}
    spec = ((4, ">"), (8, ">")) + ((20, ">"),) * len(links)
    table = [line(_("{model}, {mesh}, {m} micro-batches of 1 sequence; compute {compute} s a step (modelled); seconds "
                    "to send each axis's bytes over:", model=SCENARIOS[-1][0], m=lay["microbatches"],
                    mesh=f"dp {lay['dp']} x tp {lay['tp']} x pp {lay['pp']}", compute=f"{compute:.1f}")),
             columns(spec, _("axis"), "GB/step", *(f"{k} {v / GB:.0f} GB/s" for k, v in links.items()))
             + line("   ", _("(per rank: DP of the first stage, its embedding split over TP as in Megatron-LM; PP of a "
                             "middle stage, which sends activations forward and gradients back)"))]
    table += [columns(spec, axis, f"{b / GB:.1f}", *(f"{b / v:.2f}" for v in links.values()))
              for axis, b in comm.items()]
    show(Lines(table))
    claim("TP moves the most bytes of the three axes: over NVLink a fraction of the compute, over InfiniBand more "
          "than all of it", comm["tp"] > max(comm["pp"], comm["dp"])
          and comm["tp"] / links["NVLink"] < 0.25 * compute < compute < comm["tp"] / links["InfiniBand"],
          measured=f"TP {comm['tp'] / GB:.0f} GB, PP {comm['pp'] / GB:.1f} GB, DP {comm['dp'] / GB:.1f} GB")


def show_here() -> None:
    """The same bytes at the all-reduce bandwidth notebook 00 measured on this machine."""
    comm, _compute = axis_costs()
    found = bandwidth_here()
    if not found:
        raise RuntimeError("notebook 00 has neither a bandwidth run here nor a committed headline: run notebook 00")
    here, source = found
    show(Lines([line(_("at {bandwidth} GB/s ({source}): {seconds} a step", bandwidth=f"{here:.2f}", source=source,
                       seconds=", ".join(f"{axis.upper()} {b / GB / here:,.0f} s" for axis, b in comm.items())))]))
