"""Notebook 14, section 7: the learner's own layout. The planner of notebook 10 (:func:`helpers.calc.plan.propose`)
proposes layouts for a model, a number of GPUs, their memory, a sequence length and a batch; the simulation
(course/gpt_at_scale.py, :func:`.at_scale.simulate`) builds the first proposal's first and last stage and confirms or
refutes the memory the planner counted for them.

What the simulation builds is the proposal's mesh (dp, tp, pp, ep), micro-batches and recomputation with FSDP2
(ZeRO-3) for the data-parallel sharding and the embeddings whole on every TP rank: the one build torch makes here. The
planner's proposal may use ZeRO-0/1/2 (a different model-state term, measured in notebook 03) or split the
embeddings over TP (Megatron-LM's vocabulary-parallel embedding); so the simulated rank is held to the course's
formulas *for the build it is* (:func:`helpers.calc.scale.expected`: ZeRO-3, no vocabulary split, torch's sequence
parallelism), and its buffers and temporaries to the 15% the planner leaves free (:data:`helpers.calc.plan.USABLE`).

Example (notebook cells)::

    plan_and_simulate("llama3-70b", gpus=128, gpu_gb=80, seq_len=8192, global_batch=512)
    layout_planner()   # the same with controls
"""
from __future__ import annotations

import ipywidgets as w

from ...calc import plan, scale
from ..i18n import Lines, _, localized
from .at_scale import GIB, first_and_last
from .table import columns, line, show

DEFAULT = dict(model="llama3-70b", gpus=128, gpu_gb=80, seq_len=8192, global_batch=512)
GPUS_PER_NODE = 8


def proposals(model: str, gpus: int, gpu_gb: float, seq_len: int, global_batch: int) -> list[dict]:
    """The planner's layouts that fit, fastest first: 1F1B and no context parallelism (section 3 simulates CP; the
    planner's CP term, chapter 12's, would have it split sequences of 8,192 tokens where published layouts use TP)."""
    shape = dict(scale.MODELS[model], seq_len=seq_len)
    return plan.propose(shape, gpu_bytes=gpu_gb * 1e9, n_gpus=gpus, gpus_per_node=min(GPUS_PER_NODE, gpus),
                        global_batch=global_batch)


def confirm(model: str, seq_len: int, gpu_gb: float, fit: dict) -> dict:
    """Simulate the first and last stage of ``fit``'s layout; per stage the formula's and the simulation's states +
    in-flight activations, the buffers and temporaries at the peak, and whether the whole fits the GPU."""
    lay = fit["layout"]
    checkpoint = "full" if lay["checkpoint"] == "full" else "none"  # selective: the same bytes with sdpa attention
    out = {}
    for stage, (r, h) in first_and_last(model, lay["dp"], lay["tp"], lay["pp"], lay["microbatches"], lay["ep"],
                                        checkpoint, seq_len).items():
        f = r["formula"]
        formula = sum(f[k] for k in ("params", "grads", "optimizer")) + h["in_flight"] * f["activations"]
        out[stage] = dict(formula=formula, simulated=h["states"] + h["activations"], rest=h["rest"],
                          total=h["total"], fits=h["total"] <= gpu_gb * 1e9)
    return out


SPEC = ((4, ">"), (60, "<"), (9, ">"), (9, ">"))
CHECK = ((7, ">"), (10, ">"), (10, ">"), (8, ">"), (8, ">"), (4, "<"))


def _layout(lay: dict) -> str:
    ep = f" ep {lay['ep']}" if lay["ep"] > 1 else ""
    return (f"dp {lay['dp']} tp {lay['tp']} pp {lay['pp']}{ep}, ZeRO-{lay['zero']}, recompute {lay['checkpoint']}, "
            f"{lay['microbatches']} micro-batches")


def plan_lines(model: str, gpus: int, gpu_gb: float, seq_len: int, global_batch: int, top: int = 3) -> Lines:
    """The planner's first ``top`` layouts, then its first one simulated stage by stage."""
    fits = proposals(model, gpus, gpu_gb, seq_len, global_batch)
    out = [line(_("{model}: {gpus} GPUs of {gb} GB, {s} tokens a sequence, {b} sequences a step", model=model,
                  gpus=gpus, gb=gpu_gb, s=seq_len, b=global_batch))]
    if not fits:
        out.append(line(_("no layout fits: more GPUs, more memory, or shorter sequences")))
        return Lines(out)
    out.append(columns(SPEC, "", _("the planner's layouts that fit, fastest first"), _("GB/GPU"), _("step s")))
    for i, f in enumerate(fits[:top]):
        out.append(columns(SPEC, str(i + 1), _layout(f["layout"]), f"{f['bytes'] / 1e9:.1f}",
                           f"{f['seconds']['total']:.2f}"))
    shape = scale.MODELS[model]
    built = next((f for f in fits if "moe" not in shape or f["layout"]["tp"] == 1), None)  # EP without TP there
    if built is None:
        out.append(line(_("none of them is one the simulation builds (it spreads experts over EP, not TP)")))
        return Lines(out)
    out.append(line(_("layout {i}, simulated as FSDP2 builds it (ZeRO-3, embeddings whole on each TP rank), GiB "
                      "per rank at its busiest under 1F1B:", i=fits.index(built) + 1)))
    out.append(columns(CHECK, _("stage"), _("formula"), _("simulated"), _("rest"), _("total"), _("fits")))
    for stage, c in confirm(model, seq_len, gpu_gb, built).items():
        out.append(columns(CHECK, str(stage), f"{c['formula'] / GIB:.2f}", f"{c['simulated'] / GIB:.2f}",
                           f"{c['rest'] / GIB:.2f}", f"{c['total'] / GIB:.2f}", _("yes") if c["fits"] else _("no")))
    out.append(line(_("formula and simulated: model states and the activations in flight; rest: the buffers and "
                      "temporaries at the step's peak, which the planner leaves 15% of the GPU for")))
    return Lines(out)


def plan_and_simulate(model: str = DEFAULT["model"], gpus: int = DEFAULT["gpus"], gpu_gb: float = DEFAULT["gpu_gb"],
                      seq_len: int = DEFAULT["seq_len"], global_batch: int = DEFAULT["global_batch"]) -> None:
    show(plan_lines(model, gpus, gpu_gb, seq_len, global_batch))


def layout_planner() -> w.VBox:
    """The same with controls: a model, GPUs, their memory, the sequence and the batch; a button runs the planner
    and the simulation (a few seconds a stage)."""
    style = {"description_width": "130px"}
    controls = dict(
        model=w.Dropdown(options=sorted(scale.MODELS), value=DEFAULT["model"], description=localized(_("model")),
                         style=style),
        gpus=w.Dropdown(options=[8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 16384], value=DEFAULT["gpus"],
                        description=localized(_("GPUs")), style=style),
        gpu_gb=w.Dropdown(options=[24, 40, 48, 80, 96, 141, 192], value=DEFAULT["gpu_gb"],
                          description=localized(_("GB per GPU")), style=style),
        seq_len=w.Dropdown(options=[2048, 4096, 8192, 16384, 32768], value=DEFAULT["seq_len"],
                           description=localized(_("sequence")), style=style),
        global_batch=w.IntText(value=DEFAULT["global_batch"], description=localized(_("sequences a step")),
                               style=style))
    button, out = w.Button(description=localized(_("plan and simulate"))), w.Output()

    def run(_click=None):
        out.clear_output()
        with out:
            try:
                plan_and_simulate(**{k: c.value for k, c in controls.items()})
            except (ValueError, RuntimeError) as refused:
                print(refused)

    button.on_click(run)
    return w.VBox([*controls.values(), button, out])
