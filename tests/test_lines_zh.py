"""Tables and widgets in the learner's language: notebook 00's verdict, notebook 03's calculator and config builder.

Their words are :func:`helpers.notebook.i18n._` messages arranged as :class:`helpers.notebook.i18n.Lines`. A kernel in
``notebooks/zh`` shows them in Chinese; a saved English output keeps every cell's msgid and fields, and the Chinese
build renders it without running anything. The English text is what it was before the words were marked.
"""
import copy
import re

import nbformat
import pytest

from helpers.notebook import env, i18n, translate
from helpers.notebook.i18n import AUTO, Cell, Lines, _
from helpers.notebook.widgets import ConfigBuilder, zero_calculator

CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff]")
ENGLISH_RUN = re.compile(r"(?:[A-Za-z][A-Za-z'-]*\s+){3,}[A-Za-z][A-Za-z'-]*")  # four Latin words: a sentence


@pytest.fixture
def chinese(monkeypatch):
    monkeypatch.setenv("COURSE_LANGUAGE", "zh_CN")


@pytest.fixture
def english(monkeypatch, tmp_path):
    monkeypatch.delenv("COURSE_LANGUAGE", raising=False)
    monkeypatch.chdir(tmp_path)


def _report(**overrides):
    rep = {"torch_error": None, "versions": {"torch": "2.14.1", "torch_cuda": "13.0", "deepspeed": "0.19.8"},
           "gpu_count": 0, "devices": [{"kind": "cpu", "name": "Xeon"}], "backend": "gloo", "nproc": 2,
           "nvidia_smi": [], "probe_error": None, "cuda_visible_devices": None, "allreduce": None,
           "deepspeed": {"ok": True, "error": None, "accelerator": "cpu"},
           "compile": {"ok": True, "compile_s": 7.0, "error": None}}
    return rep | overrides


REPORTS = {  # every branch of env.verdict a machine can take
    "cpu": _report(),
    "cpu, all-reduce ran": _report(allreduce={"allreduce_ok": True, "world_size": 2, "backend": "gloo",
                                              "all_reduce": 3.0, "expected": 3.0}),
    "all-reduce wrong": _report(allreduce={"allreduce_ok": False, "world_size": 2, "all_reduce": 2.0,
                                           "expected": 3.0}),
    "gpus": _report(gpu_count=8, devices=[{"name": "NVIDIA H100"}], backend="nccl", deepspeed=None, compile=None),
    "gpus, no nccl": _report(gpu_count=2, devices=[{"name": "A100"}], backend="gloo",
                             deepspeed={"ok": True, "accelerator": "cpu"}),
    "smi sees gpus, cpu wheel": _report(versions={"torch": "2.14.1+cpu", "torch_cuda": None, "deepspeed": None},
                                        nvidia_smi=["GPU 0"], deepspeed={"ok": False, "error": "boom"}),
    "smi sees gpus, hidden": _report(nvidia_smi=["GPU 0", "GPU 1"], cuda_visible_devices="", probe_error="no driver",
                                     compile={"ok": False, "error": "no gcc"}),
    "no torch": _report(torch_error="No module named 'torch'"),
}


def _columns_at(text: str) -> list[int]:
    """The display column where each line's third cell (the advice) starts."""
    return [i18n.width(line[:re.search(r"\S\s{2,}(?=\S)", line[6:]).end() + 6]) for line in text.split("\n")]


def test_a_chinese_table_stays_aligned_by_display_width():
    rows = [[Cell("OK", 6), Cell(_("GPUs visible"), AUTO), Cell("  "), Cell("x")],
            [Cell("WARN", 6), Cell(_("multi-rank all-reduce"), AUTO), Cell("  "), Cell("y")]]
    english, chinese = Lines(rows).render("en"), Lines(rows).render("zh_CN")
    assert english == "OK    GPUs visible           x\nWARN  multi-rank all-reduce  y"
    assert CJK.search(chinese) and len(set(_columns_at(chinese))) == 1
    # padding by len() instead of display width would misalign it: the check below finds that
    assert len({len(line) - len(line.lstrip()) for line in chinese.split("\n")}) == 1
    naive = "\n".join(f"{a:<6}{b:<{max(len(r[1].text.render('zh_CN')) for r in rows)}}  {c}" for a, b, c in
                      [("OK", _("GPUs visible").render("zh_CN"), "x"),
                       ("WARN", _("multi-rank all-reduce").render("zh_CN"), "y")])
    assert len(set(_columns_at(naive))) == 2


@pytest.mark.parametrize("name", sorted(REPORTS))
def test_every_verdict_row_is_in_chinese_and_english_is_unchanged(name, english):
    rows = env.verdict(REPORTS[name])
    table = env.verdict_table(rows)
    for r in rows:  # the English text is the plain string it always was, and every message has a translation
        assert str(table).count(str(r["advice"])) >= 1
        for text in (r["check"], r["advice"]):
            for msgid in i18n.marked_msgids(text):
                assert msgid in i18n.catalogue("zh_CN"), msgid
    chinese = table.render("zh_CN")
    assert CJK.search(chinese)
    for r, line in zip(rows, chinese.split("\n")):  # left in English: the facts filled in (an error), code, names
        rest = line
        for value in _values(r["advice"]):
            rest = rest.replace(value, "")
        rest = re.sub(r"`[^`]*`|\([^)]*=[^)]*\)|report\([^)]*\)", "", rest)
        assert not ENGLISH_RUN.search(rest), line


def _values(text) -> list[str]:
    """The field values filled into a message (an error's text, a version), its nested messages' included."""
    if not isinstance(text, i18n.Text):
        return [text]
    return [v for k, v in text.rendered.items() if k not in text.nested] + [
        v for nested in text.nested.values() for v in _values(nested)]


def test_the_ready_rows_name_their_blockers_in_the_language_shown():
    rows = {r["check"]: r for r in env.verdict(REPORTS["cpu"])}
    advice = rows["ready for DeepSpeed"]["advice"]
    assert advice == "not yet: see multi-rank all-reduce"
    assert advice.render("zh_CN") == "还不行，见 多 rank all-reduce"


def test_a_saved_table_is_rendered_in_chinese_by_the_build(english, tmp_path):
    table = env.verdict_table(env.verdict(REPORTS["cpu, all-reduce ran"]))
    bundle = table._repr_mimebundle_()
    assert bundle["text/plain"] == str(table) and bundle[i18n.MIME]["kind"] == "lines"
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# Title"), nbformat.v4.new_code_cell("env.verdict_table(rows)")]
    nb.cells[1].outputs = [nbformat.v4.new_output("display_data", data=bundle)]
    po = translate.update(translate.notebook_sources(nb, "00_x.ipynb", "Title"), tmp_path / "00_x.po")
    for entry in po:
        entry.msgstr = "标题" if entry.msgid in ("Title", "# Title") else entry.msgid
    built = translate.build_notebook(nb, po, "00_x.ipynb")
    shown = built.cells[2].outputs[0]["data"]["text/plain"]
    assert shown == table.render("zh_CN") and "能看到 GPU" in shown
    assert nb.cells[1].outputs[0]["data"]["text/plain"] == str(table)  # the English notebook is untouched

    broken = copy.deepcopy(nb)  # a message the catalogue lacks stops the committed (strict) build
    broken.cells[1].outputs[0]["data"][i18n.MIME]["rows"][0][1]["text"]["msgid"] = "a check nobody translated"
    with pytest.raises(translate.Untranslated, match="a check nobody translated"):
        translate.build_notebook(broken, po, "00_x.ipynb")
    lenient = translate.build_notebook(broken, po, "00_x.ipynb", strict=False)
    assert "a check nobody translated" in lenient.cells[2].outputs[0]["data"]["text/plain"]


def test_the_calculator_shows_its_table_and_labels_in_the_kernels_language(chinese):
    calc = zero_calculator(7.5e9, devices=64, stage=3)
    text = calc.text()
    assert "每个设备 GB" in text and "总计" in text and "注：" in text and "1.9" in text
    assert calc.controls["devices"].description == "设备数"
    assert "论文：设备" in calc.result.value
    saved = calc._repr_mimebundle_()[i18n.MIME]
    assert i18n.Lines.from_json(saved).render("en").startswith("ZeRO stage 3: 7.5B parameters on 64 devices")
    assert i18n.Lines.from_json(saved).render("zh_CN") == text


def test_the_calculator_in_english_is_what_it_always_printed(english):
    calc = zero_calculator(7.5e9, devices=64, stage=1)
    lines = calc.text().split("\n")
    assert lines[2] == (f"{'GB per device':<18}{'paper: device':>14}{'paper: CPU':>12}")
    assert lines[6].split() == ["total", "31.4", "0.0"]
    assert calc.controls["devices"].description == "devices"


def test_the_config_builder_speaks_the_kernels_language(chinese):
    builder = ConfigBuilder("runs/x.json", world_size=2, accelerator="cpu")
    builder.controls["dtype"].value = "fp16"  # refused on a CPU: the validator's message, in Chinese
    text = builder.text()
    assert text.startswith("ConfigBuilder，文件 runs/x.json") and "没有写入，配置有问题：" in text
    problem = next(line for line in text.split("\n") if line.startswith("  - "))
    assert CJK.search(problem), problem  # from messages.po, the same sentence notebook 03 prints
    assert builder.controls["micro_batch"].description == "每个 rank 的微批次"


def test_say_prints_a_validator_message_in_the_kernels_language(chinese, capsys):
    from helpers.rank.deepspeed_facts import validate_config

    problem = validate_config({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 32,
                               "gradient_accumulation_steps": 2}, world_size=2)[0]
    i18n.say(problem)
    shown = capsys.readouterr().out
    assert CJK.search(shown) and "128" in shown and "64" in shown
    i18n.say("a line no catalogue has")
    assert capsys.readouterr().out == "a line no catalogue has\n"


def test_say_is_print_in_english(english, capsys):
    i18n.say("-", "train_batch_size 16 = 4 (micro batch per rank) x 2 (accumulation steps) x 2 (ranks)")
    said = capsys.readouterr().out
    print("-", "train_batch_size 16 = 4 (micro batch per rank) x 2 (accumulation steps) x 2 (ranks)")
    assert said == capsys.readouterr().out


def test_the_catalogue_collects_the_widgets_and_the_verdicts_messages():
    found = {s.msgid: s.occurrence for s in translate.exercise_sources()}
    assert found["GPUs visible"].startswith("helpers/notebook/env.py:")
    assert found["GB per device"].startswith("helpers/notebook/widgets.py:")
    assert found["TP degree"].startswith("helpers/notebook/step_calculator.py:")


def test_the_modules_examples_hold():
    import doctest

    failed, attempted = doctest.testmod(i18n)
    assert attempted >= 5 and failed == 0


def test_a_lessons_table_is_what_its_f_string_printed_and_aligned_in_chinese(english):
    from helpers.notebook.lessons import table

    spec = ((10, ">"), (13, ">"), (6, ">"))
    rows = [table.columns(spec, _("checkpoint"), _("measured MiB"), _("saved")),
            table.columns(spec, "selective", "4.39", "19%")]
    assert Lines(rows).render("en") == (f"{'checkpoint':>10} {'measured MiB':>13} {'saved':>6}\n"
                                        f"{'selective':>10} {'4.39':>13} {'19%':>6}")
    chinese = Lines(rows).render("zh_CN").split("\n")
    assert CJK.search(chinese[0]) and len({i18n.width(line) for line in chinese}) == 1
    failed, attempted = __import__("doctest").testmod(table)
    assert attempted >= 1 and failed == 0


def test_a_plot_label_is_chinese_only_where_matplotlib_has_a_chinese_font(chinese, monkeypatch):
    from helpers.notebook.lessons import table

    text = _("optimizer step")
    monkeypatch.setattr(table, "cjk_font", lambda: None)
    assert table.label(text) == "optimizer step"  # no glyphs: English, not empty boxes
    monkeypatch.setattr(table, "cjk_font", lambda: "Noto Sans CJK SC")
    assert table.label(text) == text.render("zh_CN") and CJK.search(table.label(text))
