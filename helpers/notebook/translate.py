"""The Chinese edition: gettext catalogues of the English prose, and the Chinese notebooks built from them.

``translations/zh_CN/NN_name.po`` holds one entry per markdown cell of ``notebooks/NN_name.ipynb`` (the msgid is
the whole cell), the notebook's title from ``course/syllabus.yml`` (msgctxt ``syllabus title``) and each comment of
the code cells tagged ``zh-comments`` (msgctxt ``code comment``: an exercise's outline, the text after ``#``);
``translations/zh_CN/exercises.po`` holds the exercise checkers' messages (every ``_("...")`` in
``helpers/notebook/exercises``); ``translations/zh_CN/checks.po`` the sentences of the check lines the English
notebooks' outputs hold, numbers as fields (:func:`helpers.notebook.checks.template`); and
``translations/zh_CN/messages.po`` the lines printed by code cells tagged ``zh-messages`` (a validator's verdicts,
the launcher's stall diagnosis), the same way. They are ordinary gettext files: Poedit or Weblate edit them.

:func:`update` brings a catalogue in line with the English source, the way ``msgmerge`` does: a cell whose text
changed keeps its old translation marked ``fuzzy`` (with the old English as ``#| msgid``), a new cell gets an empty
entry, and a removed cell's entry is kept as obsolete (``#~``). :func:`build` then makes ``notebooks/zh/NN_name.ipynb``
from the *executed* English notebook: markdown replaced by its translation, a note on what stays English put after
the title, code cells and their outputs as they are (the comments of a ``zh-comments`` cell translated, its code
untouched), except that a saved exercise verdict is shown in Chinese (from
the msgid and fields it was saved with), and so are every check line and the lines of ``zh-messages`` cells (from
their sentences' templates and numbers). Nothing is executed, so both editions show the same run. A catalogue with an
untranslated or fuzzy entry builds nothing and says which entries need work.

Example::

    python -m helpers translate          # update every catalogue, build notebooks/zh/ from notebooks/
    python -m helpers translate 03       # one notebook
"""
from __future__ import annotations

import ast
import copy
import difflib
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from . import i18n

LANG = i18n.CHINESE
CATALOGUES = i18n.TRANSLATIONS / LANG
TITLE_CONTEXT = "syllabus title"
EXERCISES = Path(__file__).resolve().parent / "exercises"
NOTE_ID = "zh-edition-note"
MESSAGES_TAG = "zh-messages"  # a code cell whose printed lines are messages for the learner (validator, launcher)
COMMENTS_TAG = "zh-comments"  # a code cell whose comments are prose for the learner (a write-the-code outline)
COMMENT_CONTEXT = "code comment"
FUZZY_CUTOFF = 0.5  # difflib ratio above which a changed cell's old translation is offered as a fuzzy match
HEADER = {
    "Project-Id-Version": "dtfz-course",
    "Language": LANG,
    "MIME-Version": "1.0",
    "Content-Type": "text/plain; charset=UTF-8",
    "Content-Transfer-Encoding": "8bit",
    "Plural-Forms": "nplurals=1; plural=0;",
}


def edition_note(english_file: str) -> str:
    """The cell the build puts after each Chinese notebook's title: what stays English, and where the terms are."""
    return (f"> **中文版说明：** 本笔记本由英文版 [`{english_file}`](../{english_file}) 生成：正文是翻译，代码单元格和"
            "它们的输出来自英文版的同一次运行。检查行（`[检查] …：True`）、ds_config 校验器和启动器给学习者的提示、"
            "环境检查的结论表、计算器和配置生成器的表格与标签、练习的判定和提示是中文；代码、日志、调用栈和其他报错"
            "信息保持英文，图里的文字也是英文（matplotlib 默认没有中文字体）。术语的译法见 [术语表](GLOSSARY.md)。")


@dataclass(frozen=True)
class Source:
    """One English string to translate: where it is (``notebooks/02_x.ipynb:<cell id>``) and its context."""

    msgid: str
    occurrence: str
    msgctxt: str | None = None


def catalogue_path(stem: str) -> Path:
    return CATALOGUES / f"{stem}.po"


def notebook_sources(nb, file: str, title: str) -> list[Source]:
    """The syllabus title, then every non-empty markdown cell of the English notebook and every comment of its
    ``zh-comments`` code cells, in order."""
    out = [Source(title, "course/syllabus.yml", TITLE_CONTEXT)]
    for index, cell in enumerate(nb.cells):
        where = f"notebooks/{file}:{cell.get('id', index)}"
        if cell.cell_type == "markdown" and cell.source.strip():
            out.append(Source(cell.source, where))
        elif cell.cell_type == "code" and COMMENTS_TAG in cell.metadata.get("tags", []):
            out += [Source(text, where, COMMENT_CONTEXT) for _start, _end, text in code_comments(cell.source)]
    return out


def code_comments(source: str) -> list[tuple[int, int, str]]:
    """(start, end, text) of each comment of a code cell's Python source: ``source[start:end]`` is its text, after
    the ``#`` and one space, trailing spaces left out. Found by :mod:`tokenize`, so a ``#`` inside a string is no
    comment."""
    import io
    import tokenize

    starts = [0]
    for row in source.splitlines(keepends=True):
        starts.append(starts[-1] + len(row))
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        skip = 2 if tok.string.startswith("# ") else 1
        body = tok.string[skip:].rstrip()
        if body:
            start = starts[tok.start[0] - 1] + tok.start[1] + skip
            out.append((start, start + len(body), body))
    return out


def localize_comments(source: str, table: dict[str, str]) -> str:
    """A code cell's source with each comment's text replaced by ``table``'s translation of it (the code, and a
    comment the table lacks, as they are)."""
    for start, end, text in reversed(code_comments(source)):
        source = source[:start] + table.get(text, text) + source[end:]
    return source


MARKED = tuple(Path(__file__).resolve().parent / name for name in (
    "widgets.py", "config_builder.py", "step_calculator.py", "env.py", "lessons/step.py",
    "lessons/comm_model.py", "lessons/activations.py", "lessons/tp.py", "lessons/pipeline.py", "lessons/schedules.py",
    "lessons/layout.py", "lessons/cp.py", "lessons/moe.py", "lessons/at_scale.py", "lessons/at_scale_plan.py"))
# beside the exercise checkers: modules whose _() messages (widget labels, the calculators' and lessons' tables and
# plot labels, notebook 00's verdict) go into the same catalogue


def exercise_sources(folder: Path = EXERCISES, also: tuple[Path, ...] = MARKED) -> list[Source]:
    """Every ``_("literal", ...)`` in the exercise checkers (and in the modules ``also``), in file and line order."""
    out = []
    root = Path(__file__).resolve().parents[2]
    for path in [*sorted(folder.glob("*.py")), *also]:
        where = path.resolve().relative_to(root).as_posix() if path.resolve().is_relative_to(root) else path.name
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "_"
                    and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                out.append(Source(node.args[0].value, f"{where}:{node.lineno}"))
    return sorted(out, key=lambda s: (s.occurrence.split(":")[0], int(s.occurrence.split(":")[1])))


def saved_lines(nb):
    """The :class:`helpers.notebook.i18n.Lines` of every saved ``lines`` output (a table, a calculator)."""
    for cell in nb.cells:
        for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
            saved = out.get("data", {}).get(i18n.MIME)
            if saved and saved.get("kind") == "lines":
                yield i18n.Lines.from_json(saved)


def _printed(notebooks: dict[str, object], tag: str | None = None):
    """(occurrence, text) of every stream output of the code cells of these English notebooks ({file: nbformat
    node}), in order, only those of cells tagged ``tag`` if given; occurrence is ``notebooks/05_x.ipynb:<cell id>``."""
    for file, nb in notebooks.items():
        for index, cell in enumerate(nb.cells):
            if cell.cell_type != "code" or (tag and tag not in cell.metadata.get("tags", [])):
                continue
            for out in cell.get("outputs", []):
                if out.get("output_type") == "stream":
                    yield f"notebooks/{file}:{cell.get('id', index)}", "".join(out.get("text", ""))


def check_sources(notebooks: dict[str, object]) -> list[Source]:
    """The template of every check line in the outputs of these English notebooks, in order, each where it was
    printed."""
    from . import checks

    return [Source(checks.template(text)[0], where) for where, printed in _printed(notebooks)
            for text, _ in checks.parse(printed)]


def is_message_line(row: str) -> bool:
    """A printed line of a ``zh-messages`` cell that is a sentence for the learner: not empty, not a check line
    (those have their own catalogue), not a stack frame or other indented code."""
    from . import checks

    return bool(row.strip()) and not row[0].isspace() and not checks.parse(row) and not row.startswith(
        ("Current thread", "Traceback", "Thread 0x"))


def message_sources(notebooks: dict[str, object]) -> list[Source]:
    """The template of every message line printed by the ``zh-messages`` cells of these English notebooks."""
    from . import checks

    return [Source(checks.template(row)[0], where) for where, printed in _printed(notebooks, MESSAGES_TAG)
            for row in printed.split("\n") if is_message_line(row)]


def localize_messages(text: str, table: dict[str, str]) -> str:
    """A ``zh-messages`` cell's printed text with each message line in Chinese (its numbers put back); a line the
    table lacks stays English."""
    # a line the table lacks: build_notebook decides whether that is allowed
    return "\n".join(i18n.localize_row(row, table) if is_message_line(row) else row for row in text.split("\n"))


def _new_catalogue():
    import polib

    po = polib.POFile(wrapwidth=100)
    po.header = ("Simplified Chinese edition of 'Distributed Training from Zero'.\n"
                 "Terms: notebooks/zh/GLOSSARY.md. Regenerate with `python -m helpers translate`; edit msgstr only.")
    po.metadata = dict(HEADER)
    return po


def update(sources: list[Source], path: Path):
    """The catalogue at ``path`` merged with ``sources`` (a new ``polib.POFile``; nothing is written)."""
    import polib

    old = polib.pofile(str(path)) if path.exists() else _new_catalogue()
    known = {(e.msgctxt, e.msgid): e for e in old}
    wanted = {(s.msgctxt, s.msgid) for s in sources}
    # translations whose English is gone: candidates for a fuzzy match, else kept as obsolete
    orphans = [e for key, e in known.items() if key not in wanted and e.msgstr]
    po = _new_catalogue()
    entries: dict[tuple, polib.POEntry] = {}
    for s in sources:
        key = (s.msgctxt, s.msgid)
        if key in entries:
            entries[key].occurrences.append((s.occurrence, ""))
            continue
        entry = polib.POEntry(msgctxt=s.msgctxt, msgid=s.msgid, msgstr="", occurrences=[(s.occurrence, "")])
        before = known.get(key)
        if before is not None:
            entry.msgstr, entry.flags = before.msgstr, [f for f in before.flags if f != "fuzzy" or before.msgstr]
            entry.previous_msgid = before.previous_msgid if before.fuzzy else None
        else:
            match = _closest(s, orphans)
            if match is not None:
                orphans.remove(match)
                entry.msgstr, entry.flags, entry.previous_msgid = match.msgstr, ["fuzzy"], match.msgid
        entries[key] = entry
        po.append(entry)
    for e in orphans:
        gone = polib.POEntry(msgctxt=e.msgctxt, msgid=e.msgid, msgstr=e.msgstr, obsolete=True)
        po.append(gone)
    return po


def _closest(source: Source, candidates):
    best, score = None, FUZZY_CUTOFF
    for e in candidates:
        if e.msgctxt != source.msgctxt:
            continue
        ratio = difflib.SequenceMatcher(None, source.msgid, e.msgid, autojunk=False).ratio()
        if ratio > score:
            best, score = e, ratio
    return best


def needs_work(po) -> list:
    """Entries a translator must look at: untranslated or fuzzy (obsolete ones are history, not work)."""
    return [e for e in po if not e.obsolete and not e.translated()]


class Untranslated(Exception):
    """A catalogue has entries that need work; the message lists them (first line of each msgid)."""

    def __init__(self, path: Path, entries: list):
        self.path, self.entries = path, entries
        lines = [f"  {'fuzzy' if e.fuzzy else 'untranslated'}: {e.msgid.splitlines()[0][:90]}"
                 for e in entries]
        super().__init__(f"{path.name}: {len(entries)} entr{'y' if len(entries) == 1 else 'ies'} to translate "
                         f"(edit msgstr, remove the fuzzy flag):\n" + "\n".join(lines))


def build_notebook(english, po, english_file: str, *, strict: bool = True):
    """The Chinese notebook (a new nbformat node) from an English notebook node and its catalogue (and the check
    lines' and messages' catalogues, :data:`helpers.notebook.i18n.CHECKS_DOMAIN`, ``MESSAGES_DOMAIN``).

    ``strict`` (the committed edition: ``regen``, ``translate``): a check or message line the catalogues lack stops
    the build. Not strict (``make course`` on the learner's machine, whose GPUs, rank counts or versions print
    sentences the committed run did not): such a line is shown in English."""
    from . import checks
    from .exercises import render_saved

    translated = {(e.msgctxt, e.msgid): e.msgstr for e in po.translated_entries()}
    missing = needs_work(po)
    if missing:
        raise Untranslated(Path(po.fpath or english_file), missing)
    needed = {i18n.CHECKS_DOMAIN: {s.msgid for s in check_sources({english_file: english})},
              i18n.MESSAGES_DOMAIN: {s.msgid for s in message_sources({english_file: english})},
              i18n.EXERCISES_DOMAIN: {m for lines in saved_lines(english) for m in lines.msgids()}} if strict else {}
    for domain, msgids in needed.items():
        unknown = msgids - set(i18n.catalogue(LANG, domain))
        if unknown:
            import polib

            raise Untranslated(catalogue_path(domain), [polib.POEntry(msgid=m) for m in sorted(unknown)])
    messages = i18n.catalogue(LANG, i18n.MESSAGES_DOMAIN)
    comments = {msgid: text for (context, msgid), text in translated.items() if context == COMMENT_CONTEXT}
    nb = copy.deepcopy(english)
    for cell in nb.cells:
        if cell.cell_type == "markdown" and cell.source.strip():
            cell.source = translated[(None, cell.source)]
        elif cell.cell_type == "code":
            if COMMENTS_TAG in cell.metadata.get("tags", []):
                cell.source = localize_comments(cell.source, comments)
            for out in cell.get("outputs", []):
                saved = out.get("data", {}).get(i18n.MIME)
                if saved and saved.get("kind") == "verdict":
                    out["data"]["text/plain"] = render_saved(saved, LANG)
                elif saved and saved.get("kind") == "lines":
                    out["data"]["text/plain"] = i18n.Lines.from_json(saved).render(LANG)
                if out.get("output_type") == "stream":
                    out["text"] = checks.localize("".join(out["text"]), LANG)
                    if MESSAGES_TAG in cell.metadata.get("tags", []):
                        out["text"] = localize_messages(out["text"], messages)
    note = nbformat.v4.new_markdown_cell(edition_note(english_file))
    note["id"] = NOTE_ID
    nb.cells.insert(1, note)
    course = nb.metadata.setdefault("course", {})
    course["edition"] = {"language": "zh-CN", "english": f"../{english_file}",
                         "title": translated.get((TITLE_CONTEXT, _title(po)), "")}
    nbformat.validate(nb)
    return nb


def _title(po) -> str:
    return next((e.msgid for e in po if e.msgctxt == TITLE_CONTEXT and not e.obsolete), "")


def chinese_path(english: Path) -> Path:
    """Where the Chinese edition of an English notebook lives: a ``zh`` folder beside it."""
    return english.parent / "zh" / english.name


def load(stem: str):
    """The catalogue ``translations/zh_CN/<stem>.po`` (``fpath`` set, so problems name the file)."""
    import polib

    path = catalogue_path(stem)
    po = polib.pofile(str(path))
    po.fpath = str(path)
    return po


def _save(po, stem: str):
    path = catalogue_path(stem)
    path.parent.mkdir(parents=True, exist_ok=True)
    po.save(str(path))
    po.fpath = str(path)
    return po


def update_catalogue(chapter, english: Path | None = None):
    """The chapter's catalogue merged with its English notebook and title, written back to disk."""
    stem = Path(chapter.file).stem
    nb = nbformat.read(english or chapter.path, as_version=4)
    return _save(update(notebook_sources(nb, chapter.file, chapter.title), catalogue_path(stem)), stem)


def update_exercises():
    po = _save(update(exercise_sources(), catalogue_path(i18n.EXERCISES_DOMAIN)), i18n.EXERCISES_DOMAIN)
    i18n.catalogue.cache_clear()
    return po


def update_checks(english_dir: Path | None = None):
    """checks.po merged with the check lines of every chapter's English notebook (``english_dir``'s copy where it
    has one, e.g. a course build's executed notebooks), written back to disk; messages.po likewise with the lines
    of the ``zh-messages`` cells. Returns both catalogues."""
    from .syllabus import syllabus

    _, chapters = syllabus()
    notebooks = {}
    for ch in chapters:
        path = english_dir / ch.file if english_dir and (english_dir / ch.file).exists() else ch.path
        notebooks[ch.file] = nbformat.read(path, as_version=4)
    done = [_save(update(sources(notebooks), catalogue_path(domain)), domain)
            for domain, sources in ((i18n.CHECKS_DOMAIN, check_sources), (i18n.MESSAGES_DOMAIN, message_sources))]
    i18n.catalogue.cache_clear()
    return done


def build(chapter, english: Path | None = None, out: Path | None = None, po=None, strict: bool = True):
    """Write the Chinese edition of ``english`` (default: the committed notebook) next to it, in ``zh/``; the
    notebook written (an nbformat node)."""
    english = english or chapter.path
    out = out or chinese_path(english)
    nb = build_notebook(nbformat.read(english, as_version=4), po or load(Path(chapter.file).stem), chapter.file,
                        strict=strict)
    out.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, out)
    return nb


@dataclass
class Edition:
    """What :func:`translate` did: the Chinese title of each chapter built (by id), and each catalogue that needs
    work (by file stem, e.g. ``02_ddp_cifar10`` or ``exercises``) with the entries to translate."""

    titles: dict[str, str] = field(default_factory=dict)
    problems: dict[str, str] = field(default_factory=dict)


def translate(chapters, *, english_dir: Path | None = None, update_catalogues: bool = True) -> Edition:
    """Update the catalogues (optional) and build each chapter's Chinese notebook next to its English one."""
    done = Edition()
    if update_catalogues:
        exercises = update_exercises()
        if needs_work(exercises):
            done.problems[i18n.EXERCISES_DOMAIN] = str(Untranslated(Path(exercises.fpath), needs_work(exercises)))
        for po in update_checks(english_dir):
            if needs_work(po):
                done.problems[Path(po.fpath).stem] = str(Untranslated(Path(po.fpath), needs_work(po)))
    root = i18n.TRANSLATIONS.parent
    for ch in chapters:
        english = (english_dir / ch.file) if english_dir else ch.path
        try:
            nb = build(ch, english, po=update_catalogue(ch, english) if update_catalogues else None,
                       strict=update_catalogues)
        except Untranslated as e:
            done.problems[Path(ch.file).stem] = str(e)
            continue
        done.titles[ch.id] = nb.metadata["course"]["edition"]["title"]
        written = chinese_path(english)
        print(f"zh  {ch.id} -> {written.relative_to(root) if written.is_relative_to(root) else written}", flush=True)
    return done
