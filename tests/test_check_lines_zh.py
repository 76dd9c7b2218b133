"""Check lines in the Chinese edition: a claim's sentence becomes a catalogue template (numbers as fields), the
Chinese build shows every saved check line in Chinese from translations/zh_CN/checks.po with its verdict and measured
value unchanged, a claim printed from notebooks/zh/ prints in Chinese, and a sentence nobody translated stops the
build instead of slipping through in English. The English lines, what nbval compares, do not change."""
from __future__ import annotations

import re

import nbformat
import polib
import pytest

from helpers.notebook import checks, i18n, translate

CHECKS_PO = translate.catalogue_path(i18n.CHECKS_DOMAIN)


def test_a_sentence_template_keeps_names_and_takes_out_the_numbers():
    text = "ZeRO-3 on 4 ranks runs at 0.9x with fp32 and 1F1B, within 5% and 1e-4, in step 12."
    msgid, numbers = checks.template(text)
    assert msgid == "ZeRO-3 on {0} ranks runs at {1}x with fp32 and 1F1B, within {2}% and {3}, in step {4}."
    assert numbers == ["4", "0.9", "5", "1e-4", "12"]
    assert checks.fill(msgid, numbers) == text
    assert checks.template("rank 0..N-1 of world_size 8")[0] == "rank {0}..N-1 of world_size {1}"


def test_a_line_renders_in_chinese_when_the_catalogue_has_its_sentence(monkeypatch):
    monkeypatch.setattr(i18n, "catalogue", lambda lang, domain=i18n.EXERCISES_DOMAIN: {
        "{0} ranks run at least {1}x": "{0} 个 rank 至少跑到 {1}x"} if domain == i18n.CHECKS_DOMAIN else {})
    zh = checks.line("2 ranks run at least 0.9x", True, "1.62x", lang="zh_CN")
    assert zh == "[检查] 2 个 rank 至少跑到 0.9x：True（实测：1.62x）"
    assert checks.parse(zh) == [("2 个 rank 至少跑到 0.9x", True)]
    assert checks.line("2 ranks run at least 0.9x", False, lang="en") == "[check] 2 ranks run at least 0.9x: False"
    assert checks.line("a sentence nobody translated", True, lang="zh_CN") == \
        "[check] a sentence nobody translated: True"
    saved = "loss 1.23\n[check] 3 ranks run at least 0.9x: False   (measured: 0.5x)\ndone\n"
    assert checks.localize(saved, "zh_CN") == "loss 1.23\n[检查] 3 个 rank 至少跑到 0.9x：False（实测：0.5x）\ndone\n"


def test_a_claim_from_the_chinese_folder_prints_in_chinese(monkeypatch, capsys):
    monkeypatch.setenv("COURSE_LANGUAGE", "zh_CN")
    entry = next(e for e in polib.pofile(str(CHECKS_PO)).translated_entries() if not checks.FIELD.search(e.msgid))
    checks.claim(entry.msgid, True, measured="x")
    assert capsys.readouterr().out == f"[检查] {entry.msgstr}：True（实测：x）\n"


def test_every_translation_keeps_its_fields_and_reads_as_one_line():
    po = polib.pofile(str(CHECKS_PO))
    assert not translate.needs_work(po), f"{len(translate.needs_work(po))} check sentences to translate"
    for e in po.translated_entries():
        assert sorted(checks.FIELD.findall(e.msgstr)) == sorted(checks.FIELD.findall(e.msgid)), e.msgid
        assert "\n" not in e.msgstr and not e.msgstr.endswith(("。", ".")), e.msgid
        assert re.search(r"[\u4e00-\u9fff]", e.msgstr), e.msgid


def test_an_untranslated_check_sentence_stops_the_committed_build_and_shows_english_in_a_learners(tmp_path):
    from helpers.notebook.runner import syllabus

    _, chapters = syllabus()
    chapter = chapters[0]
    nb = nbformat.read(chapter.path, 4)
    cell = next(c for c in nb.cells if c.cell_type == "code" and any(
        checks.parse(o.get("text", "")) for o in c.get("outputs", []) if o.get("output_type") == "stream"))
    out = next(o for o in cell.outputs if o.get("output_type") == "stream" and checks.parse(o["text"]))
    out["text"] += "[check] a sentence the catalogue has never seen: True\n"
    with pytest.raises(translate.Untranslated, match="checks.po: 1 entry"):
        translate.build_notebook(nb, translate.load(chapter.path.stem), chapter.file)
    # a learner's `make course` (not strict): the sentence the committed run never printed is shown in English
    built = translate.build_notebook(nb, translate.load(chapter.path.stem), chapter.file, strict=False)
    shown = "".join(o.get("text", "") for c in built.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "[check] a sentence the catalogue has never seen: True" in shown and "[检查] " in shown


def test_a_message_cell_shows_its_sentences_in_chinese_and_leaves_code_as_it_is():
    table = {"--- Python stack of rank {0} when it stalled ---": "--- rank {0} 卡住时的 Python 调用栈 ---"}
    text = ("--- Python stack of rank 1 when it stalled ---\nCurrent thread 0x00007f (most recent call first):\n"
            '  File "course/x.py", line 44 in main\n')
    shown = translate.localize_messages(text, table)
    assert shown.splitlines() == ["--- rank 1 卡住时的 Python 调用栈 ---", "Current thread 0x00007f (most recent call "
                                  "first):", '  File "course/x.py", line 44 in main']
    assert not translate.is_message_line("[check] x: True") and not translate.is_message_line("  File x")
    assert translate.localize_messages("a sentence nobody translated\n", table) == "a sentence nobody translated\n"


def test_the_validators_and_the_stall_diagnosis_are_shown_in_chinese():
    """03's ds_config validator (the blog's '2 x 32 = 64' batch bug explained) and 06's stacks of a stalled run."""
    zh = {ch: nbformat.read(translate.chinese_path(path), 4) for ch, path in (
        ("03", next(translate.CATALOGUES.parent.parent.glob("notebooks/03_*.ipynb"))),
        ("06", next(translate.CATALOGUES.parent.parent.glob("notebooks/06_*.ipynb"))))}
    printed = {ch: "".join(o.get("text", "") for c in nb.cells if translate.MESSAGES_TAG in c.metadata.get("tags", [])
                           for o in c.get("outputs", [])) for ch, nb in zh.items()}
    assert "batch size 对不上" in printed["03"] and "漏了 gradient_accumulation_steps=2" in printed["03"]
    assert "batch arithmetic" not in printed["03"]
    assert "卡住时的 Python 调用栈" in printed["06"] and "when it stalled" not in printed["06"]
    assert 'File "' in printed["06"], "the stack frames stay as they were printed"
    po = polib.pofile(str(translate.catalogue_path(i18n.MESSAGES_DOMAIN)))
    assert po.translated_entries() and not translate.needs_work(po)
    for e in po.translated_entries():
        assert sorted(checks.FIELD.findall(e.msgstr)) == sorted(checks.FIELD.findall(e.msgid)), e.msgid


def test_the_check_and_message_catalogues_are_current():
    """checks.po and messages.po are what `python -m helpers translate` writes from the committed English notebooks
    (a changed claim or message shows up here as untranslated until its translation is updated)."""
    from helpers.notebook.runner import syllabus

    _, chapters = syllabus()
    notebooks = {ch.file: nbformat.read(ch.path, 4) for ch in chapters}
    for domain, sources in ((i18n.CHECKS_DOMAIN, translate.check_sources),
                            (i18n.MESSAGES_DOMAIN, translate.message_sources)):
        path = translate.catalogue_path(domain)
        merged = translate.update(sources(notebooks), path)
        assert not translate.needs_work(merged), str(translate.Untranslated(path, translate.needs_work(merged)))
        assert str(merged) == path.read_text(), f"{path.name} is stale: run `python -m helpers translate`"
