"""Interactive widgets for the notebooks: the ZeRO memory calculator.

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
        notes.append("DeepSpeed offloads optimizer states only with ZeRO stage 1, 2 or 3: nothing moved to CPU.")
        return False, False
    if params and stage < 3:
        notes.append("DeepSpeed offloads parameters only with ZeRO stage 3 (offload_param): they stay on the device.")
        params = False
    return optimizer, params


def _deepspeed_row(params: float, devices: int, stage: int, optimizer_off: bool, params_off: bool,
                   largest_layer: int, notes: list) -> dict | None:
    if stage not in (2, 3):
        notes.append("DeepSpeed has estimators for ZeRO stages 2 and 3 only.")
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
            notes.append("DeepSpeed's estimators assume 16-bit parameters (mixed precision) whatever you pick here.")
        if stage == 3 and largest_layer_params is None:
            notes.append(f"ZeRO-3 estimate assumes the largest layer holds {LARGEST_LAYER_FRACTION:.0%} of the "
                         f"parameters ({_params_label(largest)}), like GPT-3 6.7B's token embedding.")
        if not optimizer_off:
            notes.append("DeepSpeed's device figure charges 18 bytes per partitioned parameter (the paper's 2 + 12 "
                         "plus a 4-byte fp32 gradient copy)" + (", and room to gather the largest layer." if stage == 3
                                                                else "."))
        else:
            notes.append("With the optimizer offloaded DeepSpeed moves the gradients to CPU too (ZeRO-Offload); the "
                         "device keeps the 16-bit parameters" + (" not offloaded and room to gather the largest layer."
                                                                 if stage == 3 else "."))
        notes.append("DeepSpeed's CPU figure is host memory per node, with its 1.5x buffer factor.")
    return ZeroFigures(params=params, devices=devices, stage=stage, precision=precision, offload=offload,
                       paper=paper, paper_device=device, paper_cpu=cpu, by_stage=by_stage, deepspeed=ds, notes=notes)


_ROWS = (("params", "parameters"), ("grads", "gradients"), ("optimizer", "optimizer states"), ("total", "total"))


def _heading(f: ZeroFigures) -> str:
    k = memory.PRECISIONS[f.precision][2]
    return (f"ZeRO stage {f.stage}: {_params_label(f.params)} parameters on {f.devices} devices, "
            f"{f.precision} precision (K = {k}), offload: {f.offload}")


def _stage_line(f: ZeroFigures) -> str:
    return "paper total per device by stage: " + ", ".join(
        f"{s}: {_gb(b)}" for s, b in f.by_stage.items()) + " GB"


def _nodes(ds: dict) -> str:
    return f"{ds['nodes']} node{'s' if ds['nodes'] > 1 else ''} x {ds['per_node']} devices"


def render_text(f: ZeroFigures) -> str:
    """Plain-text table of :class:`ZeroFigures` (GB = 1e9 bytes)."""
    lines = [_heading(f), ""]
    ds = f.deepspeed
    lines.append(f"{'GB per device':<18}{'paper: device':>14}{'paper: CPU':>12}"
                 + (f"{'DeepSpeed: device':>19}{'DeepSpeed: CPU/node':>21}" if ds else ""))
    for key, label in _ROWS:
        row = f"{label:<18}{_gb(f.paper_device[key]):>14}{_gb(f.paper_cpu[key]):>12}"
        if ds and key == "total":
            row += f"{_gb(ds['device']):>19}{_gb(ds['cpu_per_node']):>21}"
        lines.append(row.rstrip())
    if ds:
        lines.append(f"DeepSpeed row: {ds['options']} ({_nodes(ds)})")
    lines.append(_stage_line(f))
    lines.extend(f"note: {n}" for n in f.notes)
    return "\n".join(lines)


def render_html(f: ZeroFigures) -> str:
    """The same figures as :func:`render_text`, as an HTML table."""
    ds = f.deepspeed
    esc = html.escape
    th = "padding:2px 10px;text-align:right;border-bottom:1px solid #999"
    td = "padding:2px 10px;text-align:right;font-family:monospace"
    head = (f"<tr><th style='{th};text-align:left'>GB per device</th><th style='{th}'>paper: device</th>"
            f"<th style='{th}'>paper: CPU</th>"
            + (f"<th style='{th}'>DeepSpeed: device</th><th style='{th}'>DeepSpeed: CPU/node</th>" if ds else "")
            + "</tr>")
    body = []
    for key, label in _ROWS:
        weight = "font-weight:bold;" if key == "total" else ""
        cells = (f"<td style='{td};text-align:left;font-family:inherit;{weight}'>{label}</td>"
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
        parts.append(f"<div>DeepSpeed row: <code>{esc(ds['options'])}</code> "
                     f"({esc(_nodes(ds))})</div>")
    parts.append(f"<div>{esc(_stage_line(f))}</div>")
    parts.extend(f"<div style='color:#555'>note: {esc(n)}</div>" for n in f.notes)
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
                                       description="parameters (B)", style=style, continuous_update=False,
                                       layout=w.Layout(width="420px")),
            "devices": w.Dropdown(options=sorted(set(DEVICE_CHOICES) | {devices}), value=devices,
                                  description="devices", style=style),
            "stage": w.ToggleButtons(options=[("0", 0), ("1", 1), ("2", 2), ("3", 3)], value=int(stage),
                                     description="ZeRO stage", style={**style, "button_width": "48px"},
                                     tooltips=["plain data parallel", "optimizer states split",
                                               "+ gradients split", "+ parameters split"]),
            "precision": w.ToggleButtons(options=["mixed", "fp32"], value=precision, description="precision",
                                         style={**style, "button_width": "70px"}),
            "offload": w.ToggleButtons(options=list(OFFLOADS), value=offload, description="offload to CPU",
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

    def text(self) -> str:
        """The figures now shown, as :func:`zero_calculator_text` prints them."""
        return render_text(self.figures())

    def _update(self, _change=None) -> None:
        self.result.value = render_html(self.figures())

    def _repr_mimebundle_(self, **kwargs):
        data = super()._repr_mimebundle_(**kwargs)
        data["text/plain"] = self.text()  # what nbval compares and a static render shows, instead of a repr
        return data


# --------------------------------------------------------------------------------------------- ds_config builder


class ConfigBuilder(w.VBox):
    """Choose a few things, see the ds_config they make and what is wrong with it, write it to a JSON file.

    The file is written only when :func:`helpers.calc.dsconfig.build` finds no problem for this machine's accelerator,
    so whatever it writes is a config ``course/ds_cifar10.py --deepspeed_config <file>`` accepts.

    Example::

        builder = ConfigBuilder("runs/my_ds_config.json", world_size=2)
        builder          # in a notebook: the controls, a live preview, and a "write" button
        builder.write()  # the same as pressing the button; returns the path, or None if the config has problems
    """

    def __init__(self, path="runs/ds_config.json", world_size: int = 2, accelerator: str | None = None):
        from ..calc import dsconfig
        self._dsconfig = dsconfig
        self.accelerator = accelerator
        style = {"description_width": "150px"}
        self.controls = {
            "stage": w.ToggleButtons(options=[0, 1, 2, 3], value=2, description="ZeRO stage", style=style),
            "dtype": w.ToggleButtons(options=["fp32", "bf16", "fp16"], value="fp32", description="precision",
                                     style=style),
            "micro_batch": w.BoundedIntText(value=32, min=1, max=4096, description="micro batch / rank", style=style),
            "accumulation": w.BoundedIntText(value=1, min=1, max=1024, description="accumulation steps",
                                             style=style),
            "world_size": w.BoundedIntText(value=world_size, min=1, max=4096, description="ranks", style=style),
            "lr": w.FloatLogSlider(value=1e-3, base=10, min=-6, max=-1, description="learning rate", style=style),
            "warmup_steps": w.BoundedIntText(value=0, min=0, max=10**6, description="warmup steps", style=style),
            "clip": w.BoundedFloatText(value=1.0, min=0, max=1e6, description="clip norm (0 = off)", style=style),
            "offload": w.Dropdown(options=[("none", None), ("optimizer", "optimizer"), ("params", "param"),
                                           ("both", "both")], value=None, description="offload to CPU",
                                  style=style),
        }
        self.path = w.Text(value=str(path), description="file", style=style)
        self.button = w.Button(description="write ds_config", button_style="primary")
        self.result = w.HTML()
        self.result.add_class("ds-config-builder-result")
        for c in self.controls.values():
            c.observe(lambda _change: self._refresh(), names="value")
        self.button.on_click(lambda _b: self.write())
        super().__init__([*self.controls.values(), self.path, self.button, self.result])
        self._refresh()

    def choices(self) -> dict:
        values = {k: c.value for k, c in self.controls.items()}
        values["clip"] = values["clip"] or None
        return values

    def config(self) -> dict:
        """The config for the current choices; raises ``dsconfig.ConfigError`` saying what to change."""
        from ..launch.machine import cuda_capabilities
        from ..rank import deepspeed_facts
        accelerator = self.accelerator or deepspeed_facts.accelerator()
        # bf16 needs compute capability 8.0+; asked of a subprocess, the kernel never touches CUDA
        capabilities = cuda_capabilities() if accelerator == "cuda" else None
        return self._dsconfig.build(**self.choices(), accelerator=accelerator, capabilities=capabilities,
                                    facts=deepspeed_facts.facts())

    def _refresh(self, written=None) -> None:
        import json
        try:
            text = json.dumps(self.config(), indent=2)
            note = f"<p>written to <code>{html.escape(str(written))}</code></p>" if written else ""
            self.result.value = f"{note}<pre>{html.escape(text)}</pre>"
        except self._dsconfig.ConfigError as err:
            items = "".join(f"<li>{html.escape(p)}</li>" for p in err.problems)
            self.result.value = f"<p><b>not written, the config has problems:</b></p><ul>{items}</ul>"

    def write(self):
        """Write the config to the chosen file if it is valid; returns the path, or None."""
        try:
            path = self._dsconfig.save(self.config(), self.path.value)
        except self._dsconfig.ConfigError:
            self._refresh()
            return None
        self._refresh(written=path)
        return path

    def text(self) -> str:
        """What a saved notebook, nbval and a terminal show: the choices, then the config they make (or its
        problems) -- the same content the live widget renders."""
        import json
        choices = ", ".join(f"{k}={v!r}" for k, v in self.choices().items())
        try:
            body = json.dumps(self.config(), indent=2)
        except self._dsconfig.ConfigError as err:
            body = "not written, the config has problems:\n" + "\n".join(f"  - {p}" for p in err.problems)
        return f"ConfigBuilder for {self.path.value}\nchoices: {choices}\n{body}"

    def __repr__(self) -> str:
        return self.text()

    def _repr_mimebundle_(self, **kwargs):
        data = super()._repr_mimebundle_(**kwargs)
        data["text/plain"] = self.text()  # in full: ipywidgets cuts a widget's repr at 110 characters
        return data


def config_builder(path="runs/ds_config.json", world_size: int = 2, accelerator: str | None = None) -> ConfigBuilder:
    """A :class:`ConfigBuilder` (see there)."""
    return ConfigBuilder(path, world_size, accelerator)
