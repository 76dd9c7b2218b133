"""Interactive widgets for the notebooks: the ZeRO memory calculator (and, re-exported from
:mod:`helpers.notebook.config_builder`, the ds_config builder).

The calculator puts two answers to "how many bytes of model states does each device hold?" side by side: the ZeRO
paper's formula (Rajbhandari et al. 2020, arXiv:1910.02054, Fig. 1) and DeepSpeed's own estimator (stages 2 and 3).
Every figure comes from :mod:`helpers.calc.memory` and DeepSpeed's estimator
(:func:`helpers.rank.deepspeed_facts.deepspeed_estimate`); this module only chooses, arranges and labels them.

Example::

    from helpers.notebook.widgets import zero_calculator, zero_calculator_text
    zero_calculator()                               # sliders and toggles; the table follows them
    print(zero_calculator_text(7.5e9, 64, stage=1)) # the same figures as text: total 31.4 GB per device
"""
from __future__ import annotations

import html
from dataclasses import dataclass

import ipywidgets as w

from ..calc import memory
from ..rank.deepspeed_facts import deepspeed_estimate
# the ds_config builder lives in config_builder.py; notebook 03 imports it from here
from .config_builder import NOT_WRITTEN, ConfigBuilder, config_builder  # noqa: F401
from .i18n import MIME, Cell, Lines, _, localized

OFFLOADS = ("none", "optimizer", "optimizer+params")
DEVICE_CHOICES = tuple(2 ** i for i in range(11))  # 1 .. 1024
GPUS_PER_NODE = 8  # DeepSpeed's estimate is per node for host memory; 8 accelerators a node is the common server
# DeepSpeed's ZeRO-3 estimate reserves room to gather the largest layer. For a hypothetical model we assume 3% of
# the parameters: GPT-3 6.7B (Brown et al. 2020, Table 2.1: d_model 4096) has a 50257 x 4096 token embedding, 3.1%.
LARGEST_LAYER_FRACTION = 0.03
GB = 1e9  # the paper's GB; DeepSpeed prints GiB (2**30), converted here so both columns share a unit


def _gb(nbytes: float) -> str:
    """One decimal from 1 GB up (the paper's precision: 120, 31.4, 16.6, 1.9 GB), two significant digits below."""
    value = nbytes / GB
    if value >= 1 or value == 0:
        return f"{value:.1f}"
    return f"{value:.2g}"


def _params_label(params: float) -> str:
    return f"{params / 1e9:.3g}B" if params >= 1e9 else f"{params / 1e6:.3g}M"


@dataclass
class ZeroFigures:
    """Everything the calculator shows, computed once for both the text and the HTML rendering."""

    params: float
    devices: int
    stage: int
    precision: str
    offload: str
    paper: dict  # bytes per device by the formula: params, grads, optimizer, total
    paper_device: dict  # what stays on the device after offload (same keys)
    paper_cpu: dict  # what moved to host memory, per device (same keys)
    by_stage: dict  # stage -> paper total bytes per device without offload
    deepspeed: dict | None  # device and cpu_per_node (bytes), options, nodes, per_node; None for stages 0 and 1
    notes: list


def _effective_offload(stage: int, offload: str, notes: list) -> tuple[bool, bool]:
    """(optimizer offloaded, params offloaded) as DeepSpeed allows them at this stage; notes say what was dropped."""
    optimizer = offload in ("optimizer", "optimizer+params")
    params = offload == "optimizer+params"
    if optimizer and stage == 0:
        notes.append(_("DeepSpeed offloads optimizer states only with ZeRO stage 1, 2 or 3: nothing moved to CPU."))
        return False, False
    if params and stage < 3:
        notes.append(_("DeepSpeed offloads parameters only with ZeRO stage 3 (offload_param): they stay on the "
                       "device."))
        params = False
    return optimizer, params


def _deepspeed_row(params: float, devices: int, stage: int, optimizer_off: bool, params_off: bool,
                   largest_layer: int, notes: list) -> dict | None:
    if stage not in (2, 3):
        notes.append(_("DeepSpeed has estimators for ZeRO stages 2 and 3 only."))
        return None
    # whole 8-accelerator nodes where the count allows, else one node of them all (DeepSpeed's CPU column is per node)
    per_node = GPUS_PER_NODE if devices % GPUS_PER_NODE == 0 else devices
    nodes = devices // per_node
    est = deepspeed_estimate(int(params), num_gpus_per_node=per_node, num_nodes=nodes, stage=stage,
                             largest_layer_params=largest_layer if stage == 3 else None)

    def is_cpu(value) -> bool:  # DeepSpeed prints the enum, e.g. "OffloadDeviceEnum.cpu" or "cpu"
        return str(value).split(".")[-1] == "cpu"

    for row in est["rows"]:
        opts = row["options"]
        if is_cpu(opts.get("offload_optimizer")) != optimizer_off:
            continue
        if stage == 3 and (is_cpu(opts.get("offload_param")) != params_off or not opts.get("zero_init")):
            continue
        chosen = ", ".join(f"{k}={'cpu' if is_cpu(v) else v}" for k, v in opts.items())
        return {"device": row["per_gpu_bytes"], "cpu_per_node": row["per_cpu_bytes"], "options": chosen,
                "nodes": nodes, "per_node": per_node}
    raise RuntimeError(f"no DeepSpeed estimate row for stage {stage}, offload optimizer={optimizer_off}, "
                       f"params={params_off} in:\n{est['text']}")


def zero_figures(params: float = 7.5e9, devices: int = 64, stage: int = 3, precision: str = "mixed",
                 offload: str = "none", *, largest_layer_params: float | None = None) -> ZeroFigures:
    """The calculator's figures as data (bytes). See :func:`zero_calculator_text` for the arguments."""
    if offload not in OFFLOADS:
        raise ValueError(f"offload must be one of {', '.join(OFFLOADS)}, got {offload!r}")
    devices, stage = int(devices), int(stage)
    notes: list = []
    paper = memory.zero_model_state_bytes(params, devices, stage, precision)
    optimizer_off, params_off = _effective_offload(stage, offload, notes)
    moved = {"params": params_off, "grads": False, "optimizer": optimizer_off}
    device = {k: (0.0 if moved[k] else paper[k]) for k in moved}
    cpu = {k: (paper[k] if moved[k] else 0.0) for k in moved}
    device["total"], cpu["total"] = sum(device.values()), sum(cpu.values())
    by_stage = {s: memory.zero_model_state_bytes(params, devices, s, precision)["total"] for s in memory.STAGES}
    largest = int(largest_layer_params if largest_layer_params is not None else params * LARGEST_LAYER_FRACTION)
    ds = _deepspeed_row(params, devices, stage, optimizer_off, params_off, largest, notes)
    if ds is not None:
        if precision != "mixed":
            notes.append(_("DeepSpeed's estimators assume 16-bit parameters (mixed precision) whatever you pick here."))
        if stage == 3 and largest_layer_params is None:
            notes.append(_("ZeRO-3 estimate assumes the largest layer holds {share:.0%} of the parameters ({largest}), "
                           "like GPT-3 6.7B's token embedding.", share=LARGEST_LAYER_FRACTION,
                           largest=_params_label(largest)))
        if not optimizer_off:
            notes.append(_("DeepSpeed's device figure charges 18 bytes per partitioned parameter (the paper's 2 + 12 "
                           "plus a 4-byte fp32 gradient copy), and room to gather the largest layer.") if stage == 3
                         else _("DeepSpeed's device figure charges 18 bytes per partitioned parameter (the paper's "
                                "2 + 12 plus a 4-byte fp32 gradient copy)."))
        else:
            notes.append(_("With the optimizer offloaded DeepSpeed moves the gradients to CPU too (ZeRO-Offload); the "
                           "device keeps the 16-bit parameters not offloaded and room to gather the largest layer.")
                         if stage == 3 else
                         _("With the optimizer offloaded DeepSpeed moves the gradients to CPU too (ZeRO-Offload); the "
                           "device keeps the 16-bit parameters."))
        notes.append(_("DeepSpeed's CPU figure is host memory per node, with its 1.5x buffer factor."))
    return ZeroFigures(params=params, devices=devices, stage=stage, precision=precision, offload=offload,
                       paper=paper, paper_device=device, paper_cpu=cpu, by_stage=by_stage, deepspeed=ds, notes=notes)


def _rows():
    return (("params", _("parameters")), ("grads", _("gradients")), ("optimizer", _("optimizer states")),
            ("total", _("total")))


def _heading(f: ZeroFigures) -> str:
    k = memory.PRECISIONS[f.precision][2]
    return _("ZeRO stage {stage}: {params} parameters on {devices} devices, {precision} precision (K = {k}), offload: "
             "{offload}", stage=f.stage, params=_params_label(f.params), devices=f.devices, precision=f.precision, k=k,
             offload=f.offload)


def _stage_line(f: ZeroFigures) -> str:
    return _("paper total per device by stage: {stages} GB",
             stages=", ".join(f"{s}: {_gb(b)}" for s, b in f.by_stage.items()))


def _nodes(ds: dict) -> str:
    if ds["nodes"] > 1:
        return _("{nodes} nodes x {per_node} devices", nodes=ds["nodes"], per_node=ds["per_node"])
    return _("1 node x {per_node} devices", per_node=ds["per_node"])


def _deepspeed_line(ds: dict) -> str:
    return _("DeepSpeed row: {options} ({nodes})", options=ds["options"], nodes=_nodes(ds))


def _note(note: str) -> str:
    return _("note: {note}", note=note)


def _header(ds) -> list:
    return [_("GB per device"), _("paper: device"), _("paper: CPU")] + (
        [_("DeepSpeed: device"), _("DeepSpeed: CPU/node")] if ds else [])


def text_lines(f: ZeroFigures) -> Lines:
    """The figures as :class:`helpers.notebook.i18n.Lines` (GB = 1e9 bytes): the kernel's language, and saved so
    the Chinese edition shows them in Chinese."""
    ds = f.deepspeed
    widths = (18, 14, 12, 19, 21)
    rows = [[_heading(f)], [""],
            [Cell(label, size, "<" if i == 0 else ">") for i, (label, size) in enumerate(zip(_header(ds), widths))]]
    for key, label in _rows():
        row = [Cell(label, 18), Cell(_gb(f.paper_device[key]), 14, ">"), Cell(_gb(f.paper_cpu[key]), 12, ">")]
        if ds and key == "total":
            row += [Cell(_gb(ds["device"]), 19, ">"), Cell(_gb(ds["cpu_per_node"]), 21, ">")]
        rows.append(row)
    if ds:
        rows.append([_deepspeed_line(ds)])
    rows.append([_stage_line(f)])
    rows.extend([_note(n)] for n in f.notes)
    return Lines(rows)


def render_text(f: ZeroFigures) -> str:
    """Plain-text table of :class:`ZeroFigures` (GB = 1e9 bytes), in the kernel's language."""
    return str(text_lines(f))


def render_html(f: ZeroFigures) -> str:
    """The same figures as :func:`render_text`, as an HTML table."""
    ds = f.deepspeed
    esc = lambda text: html.escape(localized(text))  # noqa: E731
    th = "padding:2px 10px;text-align:right;border-bottom:1px solid #999"
    td = "padding:2px 10px;text-align:right;font-family:monospace"
    labels = [esc(label) for label in _header(ds)]
    head = ("<tr>" + f"<th style='{th};text-align:left'>{labels[0]}</th>"
            + "".join(f"<th style='{th}'>{label}</th>" for label in labels[1:]) + "</tr>")
    body = []
    for key, label in _rows():
        weight = "font-weight:bold;" if key == "total" else ""
        cells = (f"<td style='{td};text-align:left;font-family:inherit;{weight}'>{esc(label)}</td>"
                 f"<td style='{td};{weight}' data-key='paper-device-{key}'>{_gb(f.paper_device[key])}</td>"
                 f"<td style='{td};{weight}' data-key='paper-cpu-{key}'>{_gb(f.paper_cpu[key])}</td>")
        if ds:
            total = key == "total"
            cells += (f"<td style='{td};{weight}' data-key='deepspeed-device-{key}'>"
                      f"{_gb(ds['device']) if total else ''}</td>"
                      f"<td style='{td};{weight}' data-key='deepspeed-cpu-{key}'>"
                      f"{_gb(ds['cpu_per_node']) if total else ''}</td>")
        body.append(f"<tr>{cells}</tr>")
    parts = [f"<div><b>{esc(_heading(f))}</b></div>",
             f"<table style='border-collapse:collapse;margin:4px 0'>{head}{''.join(body)}</table>"]
    if ds:
        parts.append(f"<div>{esc(_deepspeed_line(ds))}</div>")
    parts.append(f"<div>{esc(_stage_line(f))}</div>")
    parts.extend(f"<div style='color:#555'>{esc(_note(n))}</div>" for n in f.notes)
    return "\n".join(parts)


def zero_calculator_text(params: float = 7.5e9, devices: int = 64, stage: int = 3, precision: str = "mixed",
                         offload: str = "none", *, largest_layer_params: float | None = None) -> str:
    """Model-state memory per device under ZeRO, as text: the paper's formula next to DeepSpeed's estimate.

    ``params``: parameter count; ``devices``: data-parallel ranks; ``stage``: ZeRO stage 0-3; ``precision``:
    "mixed" (K = 12) or "fp32"; ``offload``: "none", "optimizer" or "optimizer+params" (moves those bytes to the
    CPU column where DeepSpeed supports it). ``largest_layer_params`` feeds DeepSpeed's ZeRO-3 estimate (default:
    3% of ``params``). GB are 1e9 bytes, as in the paper.

    Example::

        print(zero_calculator_text(7.5e9, 64, stage=2))   # total 16.6 GB per device (paper, Fig. 1)
    """
    return render_text(zero_figures(params, devices, stage, precision, offload,
                                    largest_layer_params=largest_layer_params))


def zero_calculator(params: float = 7.5e9, devices: int = 64, stage: int = 3, precision: str = "mixed",
                    offload: str = "none", *, largest_layer_params: float | None = None) -> "ZeroCalculator":
    """An ipywidgets ZeRO memory calculator; its table (class ``zero-calculator-result``) follows the controls.

    The returned box has ``.controls`` (name -> widget: params, devices, stage, precision, offload), ``.result``
    (the HTML widget) and ``.text()`` (the current figures as :func:`zero_calculator_text` prints them; also the
    box's plain-text form, so a saved notebook shows the table where widgets do not render).

    Example::

        calc = zero_calculator(7.5e9, devices=64, stage=1)
        calc.controls["stage"].value = 2      # the table now shows 16.6 GB per device
    """
    return ZeroCalculator(params, devices, stage, precision, offload, largest_layer_params=largest_layer_params)


class ZeroCalculator(w.VBox):
    """The calculator's box: controls above the HTML table. Build it with :func:`zero_calculator`."""

    def __init__(self, params: float, devices: int, stage: int, precision: str, offload: str, *,
                 largest_layer_params: float | None = None):
        devices = int(devices)
        zero_figures(params, devices, stage, precision, offload)  # refuse bad arguments before building widgets
        style = {"description_width": "110px"}
        self.largest_layer_params = largest_layer_params
        self.controls = {
            "params": w.FloatLogSlider(value=params / 1e9, base=10, min=-2, max=3, step=0.05, readout_format=".3g",
                                       description=localized(_("parameters (B)")), style=style,
                                       continuous_update=False, layout=w.Layout(width="420px")),
            "devices": w.Dropdown(options=sorted(set(DEVICE_CHOICES) | {devices}), value=devices,
                                  description=localized(_("devices")), style=style),
            "stage": w.ToggleButtons(options=[("0", 0), ("1", 1), ("2", 2), ("3", 3)], value=int(stage),
                                     description=localized(_("ZeRO stage")), style={**style, "button_width": "48px"},
                                     tooltips=[localized(t) for t in (
                                         _("plain data parallel"), _("optimizer states split"),
                                         _("+ gradients split"), _("+ parameters split"))]),
            "precision": w.ToggleButtons(options=["mixed", "fp32"], value=precision,
                                         description=localized(_("precision")),
                                         style={**style, "button_width": "70px"}),
            "offload": w.ToggleButtons(options=list(OFFLOADS), value=offload,
                                       description=localized(_("offload to CPU")),
                                       style={**style, "button_width": "160px"}),
        }
        for name in ("stage", "precision", "offload"):  # label beside the buttons, right-aligned like the others
            self.controls[name].add_class("widget-inline-hbox")
        self.result = w.HTML()
        self.result.add_class("zero-calculator-result")
        super().__init__(children=[w.VBox(list(self.controls.values())), self.result])
        self.add_class("zero-calculator")
        for control in self.controls.values():
            control.observe(self._update, names="value")
        self._update()

    def figures(self) -> ZeroFigures:
        c = self.controls
        return zero_figures(c["params"].value * 1e9, c["devices"].value, c["stage"].value, c["precision"].value,
                            c["offload"].value, largest_layer_params=self.largest_layer_params)

    def lines(self) -> Lines:
        """The figures now shown, as :class:`helpers.notebook.i18n.Lines`."""
        return text_lines(self.figures())

    def text(self) -> str:
        """The figures now shown, as :func:`zero_calculator_text` prints them (in the kernel's language)."""
        return str(self.lines())

    def _update(self, _change=None) -> None:
        self.result.value = render_html(self.figures())

    def _repr_mimebundle_(self, **kwargs):
        data = super()._repr_mimebundle_(**kwargs)
        lines = self.lines()
        data["text/plain"] = lines.render()  # what nbval compares and a static render shows, instead of a repr
        data[MIME] = lines.to_json()  # so the Chinese edition shows a saved calculator in Chinese
        return data

