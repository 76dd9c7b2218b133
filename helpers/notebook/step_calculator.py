"""The ZeRO calculator of notebook 03 with a GPT's activations: checkpointing, tensor and sequence parallelism.

:class:`StepMemoryCalculator` is :class:`helpers.notebook.widgets.ZeroCalculator` (its controls and model-state
table unchanged) with three more controls -- activation checkpointing, the TP degree and sequence parallelism -- and
an activation table below it; the arithmetic is :func:`helpers.calc.activations.step_memory_bytes`. Notebook 03's
calculator is untouched: without a GPT shape there is nothing to add.

Example::

    calc = step_calculator(params=1e6, devices=1, stage=0, precision="fp32",
                           gpt=dict(seq_len=64, batch=8, d_model=64, n_head=4, n_layer=2, vocab=29))
    calc.controls["checkpoint"].value = "full"   # the activation rows follow
    calc.figures().activations["total"]          # bytes per device, by the formula
"""
from __future__ import annotations

import html
from dataclasses import dataclass

import ipywidgets as w

from ..calc import activations
from .i18n import Cell, Lines, _, localized
from .widgets import ZeroCalculator, ZeroFigures, render_html, text_lines

MIB = 2 ** 20
TP_CHOICES = (1, 2, 4, 8)


@dataclass
class StepFigures:
    zero: ZeroFigures  # the model states, as notebook 03's calculator shows them (devices = data-parallel ranks)
    checkpoint: str
    tp: int
    sp: bool
    activations: dict  # helpers.calc.activations.model_terms: layers, head, total (bytes per device)
    step: dict  # helpers.calc.activations.step_memory_bytes: a TP rank's model states, activations, total

    def activation_lines(self) -> Lines:
        a = self.activations
        return Lines([[_("activations per device: checkpoint={checkpoint}, TP degree {tp}, sequence parallel {sp}",
                         checkpoint=self.checkpoint, tp=self.tp, sp=_("on") if self.sp else _("off"))],
                      *([Cell(label, 18), Cell(f"{a[key] / MIB:.2f}", 12, ">"), " MiB"] for key, label in
                        (("layers", _("layers")), ("head", _("head and inputs")), ("total", _("total")))),
                      [_("model states (1/{tp} of the parameters) + activations: {mib:.2f} MiB", tp=self.tp,
                         mib=self.step["total"] / MIB)]])

    def text_lines(self) -> Lines:
        return text_lines(self.zero) + self.activation_lines()


def step_figures(params: float, devices: int, stage: int, precision: str, *, gpt: dict, checkpoint: str = "none",
                 tp: int = 1, sp: bool = False, zero: ZeroFigures | None = None) -> StepFigures:
    from .widgets import zero_figures

    zero = zero or zero_figures(params / tp, devices, stage, precision)
    step = activations.step_memory_bytes(params, devices, stage, precision, gpt=gpt, checkpoint=checkpoint, tp=tp,
                                         sp=sp)
    return StepFigures(zero, checkpoint, tp, sp, step["activations"], step)


class StepMemoryCalculator(ZeroCalculator):
    """:class:`ZeroCalculator` plus checkpointing, TP degree and sequence parallelism for a GPT's activations."""

    def __init__(self, params: float, devices: int, stage: int, precision: str, *, gpt: dict,
                 checkpoint: str = "none", tp: int = 1, sp: bool = False):
        self.gpt = dict(gpt)
        style = {"description_width": "110px"}
        self.extra = {"checkpoint": w.ToggleButtons(options=list(activations.CHECKPOINTS), value=checkpoint,
                                                    description=localized(_("checkpointing")), style=style),
                      "tp": w.Dropdown(options=TP_CHOICES, value=tp, description=localized(_("TP degree")),
                                       style=style),
                      "sp": w.Checkbox(value=sp, description=localized(_("sequence parallel")), style=style)}
        super().__init__(params, devices, stage, precision, "none")
        self.controls["params"].min = -6  # a course GPT has ~0.1M parameters; notebook 03's slider starts at 10M
        self.controls["params"].value = params / 1e9
        self.controls.update(self.extra)
        self.children = (w.VBox([*self.children[0].children, *self.extra.values()]), self.result)
        for control in self.extra.values():
            control.observe(self._update, names="value")
        self._update()

    def figures(self) -> StepFigures:
        c = self.controls
        extra = self.extra  # set before ZeroCalculator.__init__, whose first update calls this
        tp = int(extra["tp"].value)
        zero = ZeroCalculator.figures(self)
        return step_figures(c["params"].value * 1e9, c["devices"].value, c["stage"].value, c["precision"].value,
                            gpt=self.gpt, checkpoint=extra["checkpoint"].value, tp=tp, sp=bool(extra["sp"].value),
                            zero=zero if tp == 1 else None)

    def lines(self) -> Lines:
        return self.figures().text_lines()

    def _update(self, _change=None) -> None:
        f = self.figures()
        self.result.value = render_html(f.zero) + "".join(f"<div><code>{html.escape(line)}</code></div>"
                                                          for line in f.activation_lines().render().split("\n"))


def step_calculator(params: float, devices: int = 1, stage: int = 0, precision: str = "fp32", *, gpt: dict,
                    checkpoint: str = "none", tp: int = 1, sp: bool = False) -> StepMemoryCalculator:
    """The calculator for the GPT of shape ``gpt`` (seq_len, batch, d_model, n_head, n_layer, vocab[, attention,
    dtype]): ``devices`` data-parallel ranks, each holding 1/``tp`` of the weights."""
    return StepMemoryCalculator(params, devices, stage, precision, gpt=gpt, checkpoint=checkpoint, tp=tp, sp=sp)
