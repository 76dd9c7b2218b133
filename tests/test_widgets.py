"""The ZeRO memory calculator shows the paper's figures and DeepSpeed's, and follows its controls."""
import pytest

from helpers.notebook.widgets import zero_calculator, zero_calculator_text

P = 7.5e9  # the ZeRO paper's Figure 1: 7.5B parameters, 64 devices, mixed-precision Adam (K = 12)


def _row(text: str, label: str) -> list[float]:
    """Numbers of the table row that starts with ``label``: paper device, paper CPU[, DeepSpeed device, CPU/node]."""
    for line in text.splitlines():
        if line.startswith(label):
            return [float(x) for x in line[len(label):].split()]
    raise AssertionError(f"no {label!r} row in:\n{text}")


@pytest.mark.parametrize("stage, total_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_reproduces_the_zero_paper_figure_1_per_device_totals(stage, total_gb):
    text = zero_calculator_text(P, 64, stage, "mixed", "none")
    assert _row(text, "total")[0] == total_gb
    assert "paper total per device by stage: 0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9 GB" in text


def test_baseline_splits_into_2_2_and_12_bytes_per_parameter():
    text = zero_calculator_text(P, 64, 0)
    assert [_row(text, k)[0] for k in ("parameters", "gradients", "optimizer states")] == [15.0, 15.0, 90.0]


def test_fp32_uses_4_4_and_8_bytes_per_parameter():
    text = zero_calculator_text(P, 64, 0, "fp32")
    assert "K = 8" in text
    assert [_row(text, k)[0] for k in ("parameters", "gradients", "optimizer states")] == [30.0, 30.0, 60.0]


def test_offloaded_optimizer_states_move_to_the_cpu_column():
    text = zero_calculator_text(P, 64, 2, "mixed", "optimizer")
    assert _row(text, "optimizer states")[:2] == [0.0, 1.4]
    assert _row(text, "parameters")[:2] == [15.0, 0.0]
    assert _row(text, "total")[:2] == [15.2, 1.4]


def test_offloaded_parameters_move_to_the_cpu_column_at_stage_3():
    text = zero_calculator_text(P, 64, 3, "mixed", "optimizer+params")
    assert _row(text, "parameters")[:2] == [0.0, 0.23]
    assert _row(text, "optimizer states")[:2] == [0.0, 1.4]
    assert _row(text, "gradients")[:2] == [0.23, 0.0]


@pytest.mark.parametrize("stage, offload, note", [
    (1, "optimizer+params", "parameters only with ZeRO stage 3"),
    (0, "optimizer", "optimizer states only with ZeRO stage 1, 2 or 3"),
])
def test_offload_deepspeed_cannot_do_stays_on_the_device_with_a_note(stage, offload, note):
    text = zero_calculator_text(P, 64, stage, "mixed", offload)
    assert note in text
    assert _row(text, "parameters")[1] == 0.0


@pytest.mark.parametrize("stage", [0, 1])
def test_deepspeed_column_only_for_the_stages_it_estimates(stage):
    text = zero_calculator_text(P, 64, stage)
    assert len(_row(text, "total")) == 2
    assert "DeepSpeed has estimators for ZeRO stages 2 and 3 only" in text


@pytest.mark.parametrize("offload, device_gb", [
    ("none", 17.1),      # 2P + 18P/N, DeepSpeed's estimate_zero2_model_states_mem_needs without offload
    ("optimizer", 15.0),  # 2P: only the 16-bit parameters stay on the device
])
def test_deepspeed_column_is_deepspeeds_stage_2_estimate(offload, device_gb):
    text = zero_calculator_text(P, 64, 2, "mixed", offload)
    assert _row(text, "total")[2] == device_gb
    assert f"offload_optimizer={'cpu' if offload == 'optimizer' else 'none'}" in text


@pytest.mark.parametrize("offload, device_gb", [
    ("none", 0.9 + 2.1),                # 4 x largest layer + 18P/N
    ("optimizer", 0.9 + 0.23),          # 4 x largest layer + 2P/N
    ("optimizer+params", 0.9),          # 4 x largest layer
])
def test_deepspeed_column_is_deepspeeds_stage_3_estimate(offload, device_gb):
    text = zero_calculator_text(P, 64, 3, "mixed", offload, largest_layer_params=225e6)
    assert _row(text, "total")[2] == pytest.approx(device_gb, abs=0.05)


def test_bad_offload_is_refused():
    with pytest.raises(ValueError, match="offload must be one of"):
        zero_calculator_text(P, 64, 2, offload="nvme")


def test_result_widget_carries_the_class_the_browser_test_finds():
    assert "zero-calculator-result" in zero_calculator().result._dom_classes


@pytest.mark.parametrize("control, value, expected", [
    ("params", 15.0, "3.8"),     # parameters (B): 7.5 -> 15; stage 3 total 3.75 GB
    ("devices", 8, "15.0"),       # 64 -> 8 devices
    ("stage", 0, "120.0"),
    ("precision", "fp32", "K = 8"),
    ("offload", "optimizer", "offload: optimizer"),
])
def test_changing_a_control_changes_the_displayed_html(control, value, expected):
    calc = zero_calculator(P, 64, stage=3)
    before = calc.result.value
    calc.controls[control].value = value
    assert calc.result.value != before
    assert calc.text() == zero_calculator_text(**{**dict(params=P, devices=64, stage=3, precision="mixed",
                                                         offload="none"),
                                                  control: value * 1e9 if control == "params" else value})
    assert expected in calc.result.value


def test_widget_plain_text_form_is_the_calculator_text():
    calc = zero_calculator(P, 64, stage=1)
    bundle = calc._repr_mimebundle_()
    assert bundle["text/plain"] == zero_calculator_text(P, 64, 1)
    assert "application/vnd.jupyter.widget-view+json" in bundle


# --- ds_config builder


def test_config_builder_writes_a_config_the_scripts_accept(tmp_path):
    from helpers.calc import dsconfig
    from helpers.notebook.widgets import config_builder
    from helpers.rank.deepspeed_facts import check_config

    target = tmp_path / "cfg.json"
    builder = config_builder(target, world_size=2, accelerator="cpu")
    builder.controls["stage"].value = 3
    builder.controls["dtype"].value = "bf16"
    builder.controls["accumulation"].value = 2
    assert builder.write() == target
    written = dsconfig.load(target)
    check_config(written, 2, accelerator="cpu")  # raises if DeepSpeed-side rules are broken
    assert written["zero_optimization"]["stage"] == 3 and written["bf16"] == {"enabled": True}
    assert written["train_batch_size"] == 32 * 2 * 2
    assert "written to" in builder.result.value


def test_config_builder_refuses_fp16_on_cpu_and_writes_nothing(tmp_path):
    from helpers.notebook.widgets import config_builder

    target = tmp_path / "cfg.json"
    builder = config_builder(target, accelerator="cpu")
    builder.controls["dtype"].value = "fp16"
    assert "not written" in builder.result.value and "bf16" in builder.result.value
    assert builder.write() is None
    assert not target.exists()


def test_config_builder_refuses_param_offload_below_stage_3(tmp_path):
    from helpers.notebook.widgets import config_builder

    builder = config_builder(tmp_path / "cfg.json", accelerator="cpu")
    builder.controls["stage"].value = 2
    builder.controls["offload"].value = "param"
    assert "not written" in builder.result.value and "stage" in builder.result.value
    assert builder.write() is None


def test_config_builder_text_shows_the_config_or_its_problems(tmp_path):
    """A saved notebook keeps only the widget's text: it must carry what the live widget renders."""
    from helpers.notebook.widgets import config_builder
    builder = config_builder(tmp_path / "cfg.json", world_size=2, accelerator="cpu")
    builder.controls["stage"].value = 3
    text = repr(builder)
    assert "stage=3" in text and '"stage": 3' in text and "problems" not in text
    builder.controls["dtype"].value = "fp16"
    text = repr(builder)
    assert "not written, the config has problems" in text and "fp16 is enabled" in text


def test_config_builder_plain_text_form_is_its_full_text(tmp_path):
    """ipywidgets cuts a widget's repr at 110 characters in text/plain; the saved notebook must show all of it."""
    from helpers.notebook.widgets import config_builder
    builder = config_builder(tmp_path / "cfg.json", world_size=2, accelerator="cpu")
    bundle = builder._repr_mimebundle_()
    assert bundle["text/plain"] == builder.text() == repr(builder)
    assert "…" not in bundle["text/plain"] and '"train_batch_size"' in bundle["text/plain"]
    assert "application/vnd.jupyter.widget-view+json" in bundle
