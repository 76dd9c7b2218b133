"""The Chinese edition (notebooks/zh/) stays in step with the English one, by construction and by test.

* every English markdown cell and syllabus title has a current, non-fuzzy translation, and the catalogue on disk is
  exactly what ``python -m helpers translate`` writes (no pending merge);
* every Chinese notebook is exactly what the build makes from the committed English notebook and its catalogue:
  no drift, no hand edits; its code cells and outputs are the English ones (a saved exercise verdict is shown in
  Chinese from the msgid it was saved with);
* no English paragraph is left in a Chinese cell, and translations keep the code, links and structure;
* changing one English sentence fails these tests until its translation is updated;
* a Chinese notebook runs under papermill from its own folder, with Chinese exercise verdicts.
"""
import copy
import json
import os
import re
import shutil
import subprocess

import nbformat
import polib
import pytest

from helpers.notebook import checks, i18n, translate
from helpers.notebook.runner import NOTEBOOKS, ROOT, syllabus

SETTINGS, CHAPTERS = syllabus()
ZH = NOTEBOOKS / "zh"
FENCED = re.compile(r"```.*?```", re.S)

# --- is it Chinese? (the test that no English paragraph is left in a Chinese notebook) ---
INLINE_CODE = r"`(?:[^`\n]|\n(?![ \t]*\n))+`"
_CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
_LATIN_WORD = re.compile(r"[A-Za-z][A-Za-z'-]+")
_NOT_PROSE = [re.compile(p, re.S) for p in (
    r"```.*?```",          # fenced code
    INLINE_CODE,           # inline code (it may wrap onto the next line, as in the English cells)
    r"\$\$.*?\$\$", r"\$[^$\n]*\$",  # math
    r"<[^>\n]+>",          # html tags and anchors
    r"\]\([^)\s]*\)",      # link targets (the link text stays)
    r"https?://\S+",       # bare addresses
)]
MIN_CJK_SHARE = 0.25   # CJK characters / (CJK characters + Latin letters) in a cell's prose
MAX_ENGLISH_WORDS = 6  # a line with more Latin words than this and no CJK character is an untranslated line


def prose(markdown: str) -> str:
    """``markdown`` without code, math, HTML and link targets: the text a translator must translate."""
    for pattern in _NOT_PROSE:
        markdown = pattern.sub(" ", markdown)
    return markdown


def cjk_share(markdown: str) -> float:
    """CJK characters as a share of CJK characters plus Latin letters in the prose (1.0 when there is none)."""
    text = prose(markdown)
    cjk = len(_CJK.findall(text))
    latin = sum(len(w) for w in _LATIN_WORD.findall(text))
    return 1.0 if cjk + latin == 0 else cjk / (cjk + latin)


def english_lines(markdown: str) -> list[str]:
    """Lines of prose that read as untranslated English: several Latin words and not one CJK character."""
    return [line.strip() for line in prose(markdown).splitlines()
            if len(_LATIN_WORD.findall(line)) > MAX_ENGLISH_WORDS and not _CJK.search(line)]


def _stem(chapter):
    return chapter.file.rsplit(".", 1)[0]


def _catalogue(chapter):
    return translate.load(_stem(chapter))


def _english(chapter):
    return nbformat.read(chapter.path, as_version=4)


def _chinese(chapter):
    return nbformat.read(ZH / chapter.file, as_version=4)


def _spans(markdown):
    return {re.sub(r"\s+", " ", s) for s in re.findall(INLINE_CODE, FENCED.sub(" ", markdown))}


def _targets(markdown):
    return set(re.findall(r"\]\(([^)\s]*)\)", markdown)) | set(re.findall(r"<[^>\n]+>", markdown))


def _headings(markdown):
    return [len(m) for m in re.findall(r"^(#+) ", FENCED.sub(" ", markdown), re.M)]


def test_the_chinese_folder_holds_one_notebook_per_chapter_and_the_glossary():
    assert sorted(p.name for p in ZH.iterdir() if not p.name.startswith(".")) == sorted(
        [c.file for c in CHAPTERS] + ["GLOSSARY.md"])


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda c: c.id)
def test_every_english_markdown_cell_has_a_current_translation(chapter):
    path = translate.catalogue_path(_stem(chapter))
    merged = translate.update(translate.notebook_sources(_english(chapter), chapter.file, chapter.title), path)
    work = translate.needs_work(merged)
    assert not work, str(translate.Untranslated(path, work))
    assert str(merged) == path.read_text(), \
        f"{path.name} is not what `python -m helpers translate` writes from the current English: run it"


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda c: c.id)
def test_the_chinese_notebook_is_exactly_what_the_build_makes(chapter):
    built = translate.build_notebook(_english(chapter), _catalogue(chapter), chapter.file)
    assert (ZH / chapter.file).read_text() == nbformat.writes(built) + "\n", \
        f"notebooks/zh/{chapter.file} differs from its build (hand-edited, or stale): run `python -m helpers translate`"


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda c: c.id)
def test_code_cells_and_outputs_are_the_english_ones(chapter):
    english, chinese = _english(chapter), _chinese(chapter)
    note = [c for c in chinese.cells if c.get("id") == translate.NOTE_ID]
    assert len(note) == 1 and chinese.cells.index(note[0]) == 1, "one edition note, right after the title"
    cells = [c for c in chinese.cells if c.get("id") != translate.NOTE_ID]
    assert [(c.cell_type, c.get("id")) for c in cells] == [(c.cell_type, c.get("id")) for c in english.cells]
    verdicts = lines = messages = tables = 0
    for en, zh in zip(english.cells, cells):
        if en.cell_type != "code":
            continue
        if translate.COMMENTS_TAG in en.metadata.get("tags", []):  # an exercise's outline: its comments translated
            comments = {e.msgid: e.msgstr for e in _catalogue(chapter).translated_entries()
                        if e.msgctxt == translate.COMMENT_CONTEXT}
            assert zh.source == translate.localize_comments(en.source, comments) != en.source
            assert _code_only(zh.source) == _code_only(en.source), "only the comments change"
        else:
            assert zh.source == en.source
        assert zh.metadata == en.metadata and zh.execution_count == en.execution_count
        assert len(zh.outputs) == len(en.outputs)
        for out_en, out_zh in zip(en.outputs, zh.outputs):
            saved = out_en.get("data", {}).get(i18n.MIME)
            if saved and saved.get("kind") == "verdict":
                verdicts += 1
                assert out_zh["data"][i18n.MIME] == saved
                assert out_zh["data"]["text/plain"] != out_en["data"]["text/plain"]
                assert out_zh["data"]["text/plain"].startswith(("正确：", "还不对：")), out_zh["data"]["text/plain"]
                rest = {k: v for k, v in out_zh["data"].items() if k != "text/plain"}
                assert rest == {k: v for k, v in out_en["data"].items() if k != "text/plain"}
            elif saved and saved.get("kind") == "lines":  # a table or calculator: its cells rendered in Chinese
                tables += 1
                assert out_zh["data"][i18n.MIME] == saved
                assert out_zh["data"]["text/plain"] == i18n.Lines.from_json(saved).render(i18n.CHINESE)
                assert out_zh["data"]["text/plain"] != out_en["data"]["text/plain"]
                assert out_en["data"]["text/plain"] == i18n.Lines.from_json(saved).render(i18n.ENGLISH)
            elif out_en.get("output_type") == "stream" and translate.MESSAGES_TAG in en.metadata.get("tags", []):
                messages += 1
                shown = translate.localize_messages(checks.localize(out_en["text"], i18n.CHINESE),
                                                    i18n.catalogue(i18n.CHINESE, i18n.MESSAGES_DOMAIN))
                assert out_zh["text"] == shown != out_en["text"]
            elif out_en.get("output_type") == "stream" and checks.parse(out_en["text"]):
                lines += 1
                assert out_zh["text"] == checks.localize(out_en["text"], i18n.CHINESE)
                assert checks.parse(out_zh["text"]) != checks.parse(out_en["text"]), "the check lines are Chinese"
                assert [ok for _, ok in checks.parse(out_zh["text"])] == [ok for _, ok in checks.parse(out_en["text"])]
                assert "[check]" not in out_zh["text"]
                assert {k: v for k, v in out_zh.items() if k != "text"} == {k: v for k, v in out_en.items()
                                                                            if k != "text"}
            else:
                assert out_zh == out_en
    assert verdicts >= 2, "every chapter has at least two exercises whose saved verdicts are shown in Chinese"
    assert tables == sum(1 for c in english.cells if c.cell_type == "code" for o in c.get("outputs", [])
                         if o.get("data", {}).get(i18n.MIME, {}).get("kind") == "lines")
    assert lines == sum(1 for c in english.cells if c.cell_type == "code" for o in c.get("outputs", [])
                        if o.get("output_type") == "stream" and checks.parse(o["text"])
                        and translate.MESSAGES_TAG not in c.metadata.get("tags", []))
    assert messages == sum(1 for c in english.cells if translate.MESSAGES_TAG in c.metadata.get("tags", [])
                           for o in c.get("outputs", []) if o.get("output_type") == "stream")


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda c: c.id)
def test_no_english_paragraph_is_left_in_a_chinese_cell(chapter):
    for cell in _chinese(chapter).cells:
        if cell.cell_type != "markdown":
            continue
        assert not english_lines(cell.source), (cell.get("id"), english_lines(cell.source)[:3])
        share = cjk_share(cell.source)
        assert share >= MIN_CJK_SHARE, (cell.get("id"), round(share, 2), cell.source[:200])


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda c: c.id)
def test_translations_keep_code_links_headings_and_the_title(chapter):
    po = _catalogue(chapter)
    for e in po:
        if e.obsolete:
            continue
        where = e.msgid.splitlines()[0][:80]
        assert _spans(e.msgstr) == _spans(e.msgid), (where, _spans(e.msgstr) ^ _spans(e.msgid))
        assert FENCED.findall(e.msgstr) == FENCED.findall(e.msgid), (where, "fenced code changed")
        assert _targets(e.msgstr) == _targets(e.msgid), (where, _targets(e.msgstr) ^ _targets(e.msgid))
        assert _headings(e.msgstr) == _headings(e.msgid), (where, "heading levels differ")
    title = next(e.msgstr for e in po.translated_entries()
                 if e.msgctxt == translate.TITLE_CONTEXT and e.msgid == chapter.title)
    assert title != chapter.title and cjk_share(title) >= MIN_CJK_SHARE
    assert _chinese(chapter).metadata["course"]["edition"] == {
        "language": "zh-CN", "english": f"../{chapter.file}", "title": title}


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda c: c.id)
def test_relative_links_in_the_chinese_notebook_resolve_from_its_folder(chapter):
    for cell in _chinese(chapter).cells:
        if cell.cell_type != "markdown":
            continue
        for target in re.findall(r"\]\(([^)\s]*)\)", cell.source):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            assert (ZH / target.split("#")[0]).exists(), f"{chapter.file}: link {target} does not resolve in zh/"


def test_the_glossary_choices_hold_everywhere():
    """A few of GLOSSARY.md's decisions, checked over every Chinese cell: rank is not 秩, ZeRO is introduced as
    零冗余优化器, gradient accumulation is 梯度累积 (not 梯度累加)."""
    text = "\n".join(c.source for ch in CHAPTERS for c in _chinese(ch).cells if c.cell_type == "markdown")
    assert "秩" not in text
    assert "梯度累加" not in text and "梯度累积" in text
    assert "零冗余优化器" in text
    assert "GLOSSARY.md" in text


def _changed_copy(tmp_path, chapter, old, new):
    nb = copy.deepcopy(_english(chapter))
    cell = next(c for c in nb.cells if c.cell_type == "markdown" and old in c.source)
    before = cell.source
    cell.source = cell.source.replace(old, new, 1)
    path = tmp_path / chapter.file
    nbformat.write(nb, path)
    return path, before, cell.source


def _code_only(source: str) -> str:
    """A cell's source without the text of its comments."""
    for start, end, _text in reversed(translate.code_comments(source)):
        source = source[:start] + source[end:]
    return source


def test_code_comments_are_found_by_the_tokenizer_and_replaced_in_place():
    source = ('def f(x):\n    # each block: keep only x\n    s = "# not a comment"  # trailing note  \n'
              '    ...\n# print(write.solution("f"))  # a worked solution\n#\n')
    found = [text for _start, _end, text in translate.code_comments(source)]
    assert found == ["each block: keep only x", "trailing note", 'print(write.solution("f"))  # a worked solution']
    table = {"each block: keep only x": "每个 block 只保留 x", "trailing note": "行尾注释"}
    shown = translate.localize_comments(source, table)
    assert shown == ('def f(x):\n    # 每个 block 只保留 x\n    s = "# not a comment"  # 行尾注释  \n'
                     '    ...\n# print(write.solution("f"))  # a worked solution\n#\n')
    assert _code_only(shown) == _code_only(source)


def test_a_tagged_code_cells_comments_are_catalogue_entries_and_built_in_chinese(tmp_path):
    nb = nbformat.v4.new_notebook()
    outline = "def f():\n    # return the answer\n    ...\n"
    nb.cells = [nbformat.v4.new_markdown_cell("# Title"), nbformat.v4.new_code_cell(outline),
                nbformat.v4.new_code_cell("x = 1  # not tagged: stays English")]
    nb.cells[1].metadata["tags"] = ["exercise-write", translate.COMMENTS_TAG]
    po = translate.update(translate.notebook_sources(nb, "00_x.ipynb", "Title"), tmp_path / "00_x.po")
    assert [(e.msgctxt, e.msgid) for e in translate.needs_work(po)] == [
        (translate.TITLE_CONTEXT, "Title"), (None, "# Title"), (translate.COMMENT_CONTEXT, "return the answer")]
    with pytest.raises(translate.Untranslated, match="return the answer"):
        translate.build_notebook(nb, po, "00_x.ipynb")
    for entry in po:
        entry.msgstr = {"Title": "标题", "# Title": "# 标题", "return the answer": "返回答案"}[entry.msgid]
    built = translate.build_notebook(nb, po, "00_x.ipynb")
    assert built.cells[2].source == "def f():\n    # 返回答案\n    ...\n"
    assert built.cells[3].source == nb.cells[2].source
    assert nb.cells[1].source == outline  # the English notebook is untouched


def test_changing_one_english_sentence_fails_until_its_translation_is_updated(tmp_path):
    chapter = next(c for c in CHAPTERS if c.id == "01")
    catalogue = tmp_path / "catalogue.po"
    shutil.copy(translate.catalogue_path(_stem(chapter)), catalogue)
    english, before, after = _changed_copy(tmp_path, chapter, "Each copy is a", "Every copy is a")
    po = translate.update(translate.notebook_sources(nbformat.read(english, 4), chapter.file, chapter.title),
                          catalogue)
    work = translate.needs_work(po)
    assert [e.msgid for e in work] == [after]
    assert work[0].flags == ["fuzzy"] and work[0].previous_msgid == before, "offered the old translation, fuzzy"
    with pytest.raises(translate.Untranslated, match="1 entry to translate"):
        translate.build_notebook(nbformat.read(english, 4), po, chapter.file)
    # the tests above fail the same way on the real files
    assert translate.needs_work(translate.update(
        translate.notebook_sources(nbformat.read(english, 4), chapter.file, chapter.title),
        translate.catalogue_path(_stem(chapter))))
    # a translator updates the entry and removes the flag: the build goes through and uses it
    work[0].msgstr = work[0].msgstr + "（已更新）"
    work[0].flags = []
    built = translate.build_notebook(nbformat.read(english, 4), po, chapter.file)
    assert any("（已更新）" in c.source for c in built.cells if c.cell_type == "markdown")


def test_a_new_cell_is_untranslated_and_a_removed_one_is_kept_as_obsolete(tmp_path):
    chapter = next(c for c in CHAPTERS if c.id == "01")
    nb = copy.deepcopy(_english(chapter))
    removed = next(c for c in nb.cells[1:] if c.cell_type == "markdown")
    nb.cells.remove(removed)
    nb.cells.append(nbformat.v4.new_markdown_cell("A brand new closing remark with nothing like it above."))
    po = translate.update(translate.notebook_sources(nb, chapter.file, chapter.title),
                          translate.catalogue_path(_stem(chapter)))
    new = [e for e in translate.needs_work(po)]
    assert [(e.msgid, e.msgstr, e.flags) for e in new] == [
        ("A brand new closing remark with nothing like it above.", "", [])]
    gone = [e for e in po if e.obsolete]
    assert [e.msgid for e in gone] == [removed.source] and gone[0].msgstr, "the translator's work is kept"
    path = tmp_path / "x.po"
    po.save(str(path))
    assert "#~ msgid" in path.read_text()


def test_course_builds_the_chinese_edition_from_executed_copies_without_running_them(tmp_path):
    """``python -m helpers course`` hands its build folder to translate(): the Chinese notebooks come from those
    outputs (here a marked copy), into a zh/ folder beside them, and nothing is executed."""
    chapter = next(c for c in CHAPTERS if c.id == "00")
    nb = _english(chapter)
    code = next(c for c in nb.cells if c.cell_type == "code" and c.outputs)
    code.outputs = [nbformat.v4.new_output("stream", name="stdout", text="marker from this run\n")]
    nbformat.write(nb, tmp_path / chapter.file)
    edition = translate.translate([chapter], english_dir=tmp_path, update_catalogues=False)
    assert edition.problems == {}
    assert edition.titles == {chapter.id: nbformat.read(ZH / chapter.file, 4).metadata["course"]["edition"]["title"]}
    built = nbformat.read(tmp_path / "zh" / chapter.file, 4)
    assert any(o.get("text") == "marker from this run\n" for c in built.cells if c.cell_type == "code"
               for o in c.outputs)


def test_the_report_links_each_chinese_notebook_or_says_what_it_needs():
    from helpers.notebook import report
    rows = [{"id": "00", "notebook": "00_x.ipynb", "status": "ok", "seconds": 1.0, "error": "", "checks": "1/1",
             "output": "/nonexistent", "zh": "built", "zh_title": "环境检查"},
            {"id": "01", "notebook": "01_y.ipynb", "status": "ok", "seconds": 1.0, "error": "", "checks": "1/1",
             "output": "/nonexistent", "zh": "01_y.po: 2 entries to translate (edit msgstr, remove the fuzzy flag):"}]
    page = report.render(rows, "smoke", {})
    assert "<a href='notebooks/zh/00_x.ipynb'>环境检查</a>" in page
    assert "01_y.po: 2 entries to translate" in page


def test_make_lab_in_chinese_writes_the_setting_the_browser_test_starts_jupyterlab_with():
    """`make lab-zh` (or `make lab COURSE_LANGUAGE=zh_CN`) opens notebooks/zh with JupyterLab's locale set to zh_CN
    through the same settings file tests/test_browser.py's Chinese server uses; plain `make lab` stays English."""
    from browser.lab import TRANSLATION_SETTINGS

    def dry(*args):
        return subprocess.run(["make", "-n", *args], cwd=ROOT, capture_output=True, text=True, check=True,
                              env={k: v for k, v in os.environ.items() if k != "COURSE_LANGUAGE"}).stdout
    for chinese in (dry("lab-zh"), dry("lab", "COURSE_LANGUAGE=zh_CN")):
        echo = next(line for line in chinese.splitlines() if line.startswith("echo "))
        assert echo == f"echo '{json.dumps({'locale': 'zh_CN'})}' > build/lab-zh/settings/{TRANSLATION_SETTINGS}"
        assert "JUPYTERLAB_SETTINGS_DIR=build/lab-zh/settings" in chinese
        assert "notebooks/zh/00_environment_check.ipynb" in chinese
    english = dry("lab")
    assert "notebooks/00_environment_check.ipynb" in english and "lab-zh" not in english


@pytest.mark.slow
def test_a_chinese_notebook_runs_under_papermill_from_its_own_folder(tmp_path):
    """Notebook 01 in Chinese, executed with its folder as working directory (as JupyterLab runs it): the course
    scripts, data and runs resolve, every check prints True, and its check lines and exercise verdicts come out in
    Chinese."""
    import papermill as pm
    chapter = next(c for c in CHAPTERS if c.id == "01")
    out = tmp_path / chapter.file
    pm.execute_notebook(str(ZH / chapter.file), str(out), parameters=chapter.parameters["smoke"],
                        kernel_name=SETTINGS["kernel"], cwd=str(ZH), progress_bar=False, log_output=False,
                        execution_timeout=SETTINGS["cell_timeout_s"])
    executed = nbformat.read(out, 4)
    verdicts = checks.tally(executed)
    assert verdicts.total and not verdicts.failed, verdicts.failed
    texts = [o["data"]["text/plain"] for c in executed.cells if c.cell_type == "code" for o in c.outputs
             if i18n.MIME in o.get("data", {})]
    assert texts and all(t.startswith(("正确：", "还不对：")) for t in texts), texts
    assert any("提示：" in t for t in texts)
    printed = "".join(o.get("text", "") for c in executed.cells if c.cell_type == "code" for o in c.outputs)
    assert "[检查] " in printed and "[check] " not in printed, "a claim run from notebooks/zh/ prints in Chinese"
