"""The ds_config builder of notebook 03: a few choices, the DeepSpeed config they make (or what is wrong with it)
as a live preview, and a button that writes it to a JSON file. :mod:`helpers.notebook.widgets` re-exports
``ConfigBuilder`` and ``config_builder``, so the notebook's ``from helpers.notebook.widgets import config_builder``
is unchanged.

Example::

    from helpers.notebook.widgets import config_builder
    builder = config_builder("runs/my_ds_config.json", world_size=2)
    builder.write()  # the path, or None if the config has problems
"""
from __future__ import annotations

import html

import ipywidgets as w

from .i18n import MIME, Lines, _, localized, message


NOT_WRITTEN = _("not written, the config has problems:")


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
            "stage": w.ToggleButtons(options=[0, 1, 2, 3], value=2, description=localized(_("ZeRO stage")),
                                     style=style),
            "dtype": w.ToggleButtons(options=["fp32", "bf16", "fp16"], value="fp32",
                                     description=localized(_("precision")), style=style),
            "micro_batch": w.BoundedIntText(value=32, min=1, max=4096,
                                        description=localized(_("micro batch / rank")), style=style),
            "accumulation": w.BoundedIntText(value=1, min=1, max=1024, description=localized(_("accumulation steps")),
                                             style=style),
            "world_size": w.BoundedIntText(value=world_size, min=1, max=4096,
                                        description=localized(_("ranks")), style=style),
            "lr": w.FloatLogSlider(value=1e-3, base=10, min=-6, max=-1,
                                        description=localized(_("learning rate")), style=style),
            "warmup_steps": w.BoundedIntText(value=0, min=0, max=10**6,
                                        description=localized(_("warmup steps")), style=style),
            "clip": w.BoundedFloatText(value=1.0, min=0, max=1e6,
                                        description=localized(_("clip norm (0 = off)")), style=style),
            "offload": w.Dropdown(options=[("none", None), ("optimizer", "optimizer"), ("params", "param"),
                                           ("both", "both")], value=None, description=localized(_("offload to CPU")),
                                  style=style),
        }
        self.path = w.Text(value=str(path), description=localized(_("file")), style=style)
        self.button = w.Button(description=localized(_("write ds_config")), button_style="primary")
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
            note = (f"<p>{html.escape(localized(_('written to {path}', path=str(written))))}</p>"
                    if written else "")
            self.result.value = f"{note}<pre>{html.escape(text)}</pre>"
        except self._dsconfig.ConfigError as err:
            items = "".join(f"<li>{html.escape(message('- ' + p)[2:])}</li>" for p in err.problems)
            self.result.value = f"<p><b>{html.escape(localized(NOT_WRITTEN))}</b></p><ul>{items}</ul>"

    def write(self):
        """Write the config to the chosen file if it is valid; returns the path, or None."""
        try:
            path = self._dsconfig.save(self.config(), self.path.value)
        except self._dsconfig.ConfigError:
            self._refresh()
            return None
        self._refresh(written=path)
        return path

    def lines(self) -> Lines:
        """What a saved notebook, nbval and a terminal show: the choices, then the config they make (or its
        problems) -- the same content the live widget renders."""
        import json
        choices = ", ".join(f"{k}={v!r}" for k, v in self.choices().items())
        rows = [[_("ConfigBuilder for {path}", path=self.path.value)], [_("choices: {choices}", choices=choices)]]
        try:
            rows += [[row] for row in json.dumps(self.config(), indent=2).split("\n")]
        except self._dsconfig.ConfigError as err:
            rows += [[NOT_WRITTEN]] + [["  " + message("- " + p)] for p in err.problems]
        return Lines(rows)

    def text(self) -> str:
        return str(self.lines())

    def __repr__(self) -> str:
        return self.text()

    def _repr_mimebundle_(self, **kwargs):
        data = super()._repr_mimebundle_(**kwargs)
        lines = self.lines()
        data["text/plain"] = lines.render()  # in full: ipywidgets cuts a widget's repr at 110 characters
        data[MIME] = lines.to_json()
        return data


def config_builder(path="runs/ds_config.json", world_size: int = 2, accelerator: str | None = None) -> ConfigBuilder:
    """A :class:`ConfigBuilder` (see there)."""
    return ConfigBuilder(path, world_size, accelerator)
