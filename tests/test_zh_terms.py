"""The Chinese edition's word choices (notebooks/zh/GLOSSARY.md), held over every catalogue and the Chinese README.

The edition is written for readers of Zhihu and CSDN posts like the blog the course grew from, so it uses their words
(卡, 单机多卡, batch size, loss, 避坑, 断点续训), one measure word for a GPU, one way to name a section, and glosses
a term once, at its first use in the course. Each rule below is tested against a text that breaks it, so a rule that
cannot fail is caught here too.
"""
import re
from pathlib import Path

import nbformat
import polib
import pytest

from helpers.notebook import i18n
from helpers.notebook.runner import syllabus

ROOT = Path(__file__).resolve().parents[1]
_, CHAPTERS = syllabus()
ZH = ROOT / "notebooks" / "zh"
GLOSSARY = ZH / "GLOSSARY.md"
CJK = re.compile(r"[\u4e00-\u9fff]")

# word -> (pattern that must not occur, what to write instead)
FORBIDDEN = {
    "hang": (r"挂起", "卡住 / 卡死（挂起 is suspend in Chinese OS usage）"),
    "GPU measure word": (r"(?<![这那哪])[块个]\s*(?:GPU|卡)", "张（8 张 GPU、每张卡）, or 单卡 / 双卡 / 每卡"),
    "section sign": (r"§", "第 N 节"),
    "batch size": (r"批大小", "batch size（每卡 batch size、全局 batch size）"),
    "pitfall": (r"陷阱", "坑 / 避坑"),
    "collective": (r"集合操作", "集合通信"),
    "consolidate": (r"汇集", "合并"),
    "loss": (r"损失", "loss"),
    "stacked parentheses": (r"）\s*（", "one gloss, or a second sentence"),
    "noise floor": (r"底噪", "噪声底"),
    "micro-batch": (r"微步|(?<!微批次（)micro[- ]batch", "微批次（micro-batch） at its first use, then 微批次"),
    "learner": (r"学员", "学习者"),
    "TP degree": (r"TP 度", "TP 并行度"),
    "exercise checker": (r"检查器", "判题程序 (检查 is the check lines' word)"),
}
# The English article carried over: a Chinese author writes 一个 far less often than an English one writes "a".
MAX_YIGE_PER_CJK = 1 / 300
# Words the blog's readers use that the edition must use somewhere.
REQUIRED = ["单机多卡", "断点续训", "避坑", "单卡"]


def _markdown(path: Path) -> str:
    nb = nbformat.read(path, 4)
    return "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")


def texts() -> dict[str, str]:
    out = {f"notebooks/zh/{c.file}": _markdown(ZH / c.file) for c in CHAPTERS}
    po = polib.pofile(str(i18n.TRANSLATIONS / i18n.CHINESE / f"{i18n.EXERCISES_DOMAIN}.po"))
    out["exercises.po"] = "\n".join(e.msgstr for e in po if not e.obsolete)
    out["README.zh-CN.md"] = (ROOT / "README.zh-CN.md").read_text(encoding="utf-8")
    return out


def violations(text: str) -> dict[str, list[str]]:
    """Each forbidden word found in text, with a little context, by rule name."""
    found = {}
    for name, (pattern, _) in FORBIDDEN.items():
        hits = [text[max(0, m.start() - 12):m.end() + 12].replace("\n", " ") for m in re.finditer(pattern, text)]
        if hits:
            found[name] = hits
    return found


def yige_rate(text: str) -> float:
    cjk = len(CJK.findall(text))
    return text.count("一个") / cjk if cjk else 0.0


def glosses() -> list[str]:
    """The glossary's first-use glosses: the Chinese column's "term（gloss）" forms."""
    rows = [line.split("|") for line in GLOSSARY.read_text(encoding="utf-8").splitlines() if line.startswith("| ")]
    found = []
    for row in rows[2:] if rows and "英文" in rows[0][1] else rows:
        cell = row[2].strip()
        for form in re.findall(r"[^\s/、，（）]+（[^（）]+）", cell):
            found.append(form)
    return found


def repeated_glosses(chapters: list[str]) -> dict[str, int]:
    """Glosses written more than once over the course's chapters (the first use glosses, later ones do not)."""
    joined = "\n".join(chapters)
    return {g: joined.count(g) for g in glosses() if joined.count(g) > 1}


# --- the rules find what they are for ---

def test_each_rule_finds_the_word_it_forbids():
    bad = "进程挂起了；两块 GPU、每个卡上；见 §3；批大小 64；常见陷阱；集合操作；汇集检查点；损失下降；" \
          "主副本（master copy）（K = 12）；噪声的底噪；两个微步；每个 micro-batch；学员；TP 度 2；检查器"
    assert set(violations(bad)) == set(FORBIDDEN)
    assert violations("进程卡住了；两张 GPU、每张卡；这个 GPU 上；见第 3 节；每卡 batch size 64；避坑；合并检查点") == {}


def test_the_article_rate_and_the_gloss_count_measure_what_they_say():
    assert yige_rate("一个" + "中" * 280) > MAX_YIGE_PER_CJK > yige_rate("一个" + "中" * 400)
    some = glosses()
    assert "all-reduce（全规约）" in some or any("（" in g for g in some), some
    g = some[0]
    assert repeated_glosses([g, "其他", g]) == {g: 2} and repeated_glosses([g, "只写短的"]) == {}


# --- the rules hold over the edition ---

@pytest.mark.parametrize("name", list(texts()))
def test_no_forbidden_word(name):
    found = violations(texts()[name])
    assert not found, "\n".join(f"{rule} -> write {FORBIDDEN[rule][1]}: {hits[:5]}" for rule, hits in found.items())


@pytest.mark.parametrize("name", list(texts()))
def test_the_english_article_is_not_carried_over(name):
    text = texts()[name]
    assert yige_rate(text) <= MAX_YIGE_PER_CJK, (
        f"{name}: 一个 {text.count('一个')} times in {len(CJK.findall(text))} CJK characters "
        f"(at most one per {round(1 / MAX_YIGE_PER_CJK)}): drop it where English had 'a'")


def test_a_term_is_glossed_once_at_its_first_use_in_the_course():
    chapters = [_markdown(ZH / c.file) for c in CHAPTERS]
    assert not repeated_glosses(chapters), repeated_glosses(chapters)


def test_the_blogs_words_are_used():
    joined = "\n".join(texts().values())
    assert [w for w in REQUIRED if w not in joined] == []


def test_the_glossary_states_the_choices_the_tests_hold():
    table = GLOSSARY.read_text(encoding="utf-8")
    for word in ["卡住", "张", "第 N 节", "batch size", "避坑", "集合通信", "合并", "loss", "断点续训", "单机多卡"]:
        assert word in table, word
    assert "挂起（卡死）" not in table


def catalogue_texts() -> dict[str, str]:
    """Every translated string of every Chinese catalogue (notebooks, exercises and widgets, checks, messages)."""
    return {path.name: "\n".join(e.msgstr for e in polib.pofile(str(path)) if not e.obsolete)
            for path in sorted((i18n.TRANSLATIONS / i18n.CHINESE).glob("*.po"))}


def test_the_punctuation_check_finds_halfwidth_marks_in_chinese():
    from test_readme_zh import halfwidth_punctuation_problems

    assert len(halfwidth_punctuation_problems("模型状态(参数),梯度;优化器状态:三者")) == 5
    assert halfwidth_punctuation_problems("模型状态（参数），`a, b` 和 {0}（{1}）") == []


@pytest.mark.parametrize("name", list(catalogue_texts()))
def test_chinese_text_takes_fullwidth_punctuation(name):
    from test_readme_zh import halfwidth_punctuation_problems

    assert halfwidth_punctuation_problems(catalogue_texts()[name]) == []


# A line break inside a paragraph renders as a space in a browser: between two Chinese characters (or fullwidth
# punctuation) it is a stray space that a Chinese writer never types.
CJK_OR_FULLWIDTH = r"[\u3000-\u303f\u3400-\u9fff\uff00-\uffef]"
CJK_BREAK = re.compile(f"{CJK_OR_FULLWIDTH}\n{CJK_OR_FULLWIDTH}")


def cjk_line_breaks(text: str) -> list[str]:
    """Each line break between two Chinese characters in ``text``, with a little context."""
    return [text[max(0, m.start() - 10):m.end() + 10].replace("\n", "⏎") for m in CJK_BREAK.finditer(text)]


def chinese_texts() -> dict[str, list[str]]:
    """Every Chinese text a reader sees rendered, each string on its own (joining two would make a break)."""
    out = {f"notebooks/zh/{c.file}": [cell.source for cell in nbformat.read(ZH / c.file, 4).cells
                                      if cell.cell_type == "markdown"] for c in CHAPTERS}
    out |= {path.name: [e.msgstr for e in polib.pofile(str(path)) if not e.obsolete]
            for path in sorted((i18n.TRANSLATIONS / i18n.CHINESE).glob("*.po"))}
    out |= {p.name: [p.read_text(encoding="utf-8")] for p in (ROOT / "README.zh-CN.md", GLOSSARY)}
    return out


def test_the_line_break_check_finds_a_break_between_chinese_characters():
    assert len(cjk_line_breaks("模型\n状态，\n梯度（\n参数")) == 3
    assert cjk_line_breaks("模型状态\n- 梯度\nrank 0 的\n`loss`\n\n第二段") == []


CHINESE_TEXTS = chinese_texts()  # read once, not once per parametrized test


@pytest.mark.parametrize("name", list(CHINESE_TEXTS))
def test_no_line_break_between_two_chinese_characters(name):
    found = [hit for text in CHINESE_TEXTS[name] for hit in cjk_line_breaks(text)]
    assert not found, f"{len(found)} line break(s) between Chinese characters (a browser shows a space): {found[:5]}"
