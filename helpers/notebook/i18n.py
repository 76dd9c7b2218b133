"""Messages in the learner's language: English in ``notebooks/``, Simplified Chinese in ``notebooks/zh/``.

An exercise checker writes its messages as ``_("{value} is not the global batch.", value=value)``. The result is a
:class:`Text`: a ``str`` holding the English sentence (so code and tests that read it as text keep working) that
also remembers its gettext ``msgid`` and the rendered value of each field. ``text.render("zh_CN")`` looks the msgid up
in ``translations/zh_CN/exercises.po`` and fills the same fields in, so the Chinese sentence shows the same numbers.

Which language a notebook kernel speaks: ``COURSE_LANGUAGE`` (``en`` or ``zh_CN``) if set, else Chinese when the
kernel runs in a ``notebooks/zh`` folder (JupyterLab and papermill start a kernel in its notebook's folder), else
English. The built Chinese notebooks carry the English run's outputs; each message output also holds its msgid and
fields under :data:`MIME`, which is what lets ``helpers.notebook.translate`` show those outputs in Chinese without
running anything again.

Example::

    >>> from helpers.notebook.i18n import _
    >>> t = _("{value} is not the global batch.", value=48)
    >>> t, t.render("zh_CN")
    ('48 is not the global batch.', '48 不是全局 batch size。')
"""
from __future__ import annotations

import functools
import os
import re
import string
import unicodedata
from dataclasses import dataclass
from pathlib import Path

ENGLISH = "en"
CHINESE = "zh_CN"
LANGUAGES = (ENGLISH, CHINESE)
MIME = "application/vnd.dtfz.message+json"  # msgid and fields of a message output, for the Chinese build
TRANSLATIONS = Path(__file__).resolve().parents[2] / "translations"
EXERCISES_DOMAIN = "exercises"
CHECKS_DOMAIN = "checks"  # the check lines' sentences (number_template)
MESSAGES_DOMAIN = "messages"  # lines printed by cells tagged zh-messages (helpers.notebook.translate)

_ALIASES = {"en": ENGLISH, "en_us": ENGLISH, "en_gb": ENGLISH, "zh": CHINESE, "zh_cn": CHINESE, "zh_hans": CHINESE}


# a number standing alone (not part of a name such as fp32, ZeRO-3 or 1F1B); "0.9x" and "5%" keep their unit outside
NUMBER = re.compile(r"(?<![\w.\-])\d+(?:\.\d+)?(?:e-?\d+)?(?=x\b|%|[^\w.]|\.(?!\d)|$)")
FIELD = re.compile(r"\{(\d+)\}")


def number_template(text: str) -> tuple[str, list[str]]:
    """A claim's sentence as its catalogue msgid, each number a numbered field, and the numbers:
    ``number_template("4 ranks at 0.9x")`` is ``("{0} ranks at {1}x", ["4", "0.9"])``."""
    numbers: list[str] = []

    def field(m):
        numbers.append(m.group())
        return "{" + str(len(numbers) - 1) + "}"

    return NUMBER.sub(field, text), numbers


def fill_numbers(translated: str, numbers: list[str]) -> str:
    """A translated template with its numbers put back (a field the translation lacks is an error, by test)."""
    return FIELD.sub(lambda m: numbers[int(m.group(1))], translated)


def normalise(language: str) -> str:
    """``zh``, ``zh-CN``, ``zh_CN`` -> ``zh_CN``; ``en`` -> ``en``; anything else is a clear error."""
    key = language.strip().replace("-", "_").lower()
    if key not in _ALIASES:
        raise ValueError(f"unknown course language {language!r}; the course speaks {', '.join(LANGUAGES)}")
    return _ALIASES[key]


def language() -> str:
    """The language this kernel's messages are shown in (see the module docstring)."""
    chosen = os.environ.get("COURSE_LANGUAGE")
    if chosen:
        return normalise(chosen)
    cwd = Path.cwd()
    return CHINESE if cwd.name == "zh" and cwd.parent.name == "notebooks" else ENGLISH


def _parse(template: str):
    """(literal text, key, name, conversion, spec) per piece of ``template``; key and name are None after the last
    field. ``key`` is the field as written, e.g. ``n:.1f``."""
    for literal, name, spec, conversion in string.Formatter().parse(template):
        if name is None:
            yield literal, None, None, "", ""
            continue
        if not name.isidentifier():
            raise ValueError(f"message field {{{name}}} must be a plain name (pass it as a keyword): {template!r}")
        key = name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "")
        yield literal, key, name, conversion or "", spec or ""


def fields(template: str) -> list[tuple[str, str, str, str]]:
    """(key, name, conversion, spec) of each replacement field; ``key`` is the field as written, e.g. ``n:.1f``."""
    return [(key, name, conversion, spec) for _lit, key, name, conversion, spec in _parse(template) if key]


def fill(template: str, rendered: dict[str, str]) -> str:
    """``template`` with each field replaced by its already rendered text (``{{``/``}}`` stay literal braces)."""
    parts = []
    for literal, key, _name, _conversion, _spec in _parse(template):
        parts.append(literal)
        if key is None:
            continue
        if key not in rendered:
            raise KeyError(f"translation uses field {{{key}}}, which the English message does not have: {template!r}")
        parts.append(rendered[key])
    return "".join(parts)


class Text(str):
    """An English message (``str`` value) that can also be shown in another language; see :func:`_`.

    A field whose value is itself a :class:`Text` (``nested``) is shown in the same language as the message. A
    ``plain`` text is a template of its own (:func:`join`): it is never looked up in a catalogue."""

    msgid: str
    rendered: dict[str, str]
    nested: dict[str, "Text"]
    plain: bool

    def __new__(cls, msgid: str, rendered: dict[str, str], nested: dict | None = None, plain: bool = False):
        obj = super().__new__(cls, fill(msgid, rendered))
        obj.msgid, obj.rendered, obj.nested, obj.plain = msgid, dict(rendered), dict(nested or {}), plain
        return obj

    def render(self, lang: str | None = None) -> str:
        values = {**self.rendered, **{key: text.render(lang) for key, text in self.nested.items()}}
        return fill(self.msgid, values) if self.plain else render(self.msgid, values, lang)

    def to_json(self) -> dict:
        data = {"msgid": self.msgid, "fields": self.rendered}
        if self.nested:
            data["nested"] = {key: text.to_json() for key, text in self.nested.items()}
        if self.plain:
            data["plain"] = True
        return data


def _(msgid: str, **values) -> Text:
    """Mark ``msgid`` for translation and fill its fields from ``values`` (``{name}``, ``{name!r}``, ``{n:.1f}``).

    A value that is a :class:`Text`, in a field with no conversion or format spec, is translated with the message."""
    rendered, nested, names = {}, {}, set()
    for key, name, conversion, spec in fields(msgid):
        value = values[name]
        if isinstance(value, Text) and not conversion and not spec:
            nested[key] = value
        elif conversion == "r":
            value = repr(value)
        elif conversion == "s":
            value = str(value)
        elif conversion == "a":
            value = ascii(value)
        rendered[key] = format(value, spec)
        names.add(name)
    unused = set(values) - names
    if unused:
        raise TypeError(f"values {sorted(unused)} are not fields of {msgid!r}")
    return Text(msgid, rendered, nested)


def join(items, sep: str = ", ") -> Text:
    """``sep.join(items)`` as a :class:`Text` whose items (Texts or strings) are each shown in its language."""
    items = list(items)
    texts = {f"item{i}": item if isinstance(item, Text) else Text(str(item).replace("{", "{{").replace("}", "}}"),
                                                                  {}, plain=True)
             for i, item in enumerate(items)}
    msgid = sep.replace("{", "{{").replace("}", "}}").join(f"{{item{i}}}" for i in range(len(items)))
    return Text(msgid, {key: str(text) for key, text in texts.items()}, texts, plain=True)


def as_json(text: str) -> dict:
    """A message as stored under :data:`MIME`; a plain ``str`` is its own msgid (it is then not translated)."""
    return text.to_json() if isinstance(text, Text) else {"msgid": text, "fields": {}, "plain": True}


def from_json(data: dict) -> str:
    """The message :func:`as_json` stored: a :class:`Text`, or the ``str`` itself if it was never marked."""
    if data.get("plain") and not data.get("fields") and not data.get("nested"):
        return data["msgid"]
    nested = {key: from_json(value) for key, value in data.get("nested", {}).items()}
    return Text(data["msgid"], data.get("fields", {}),
                {key: value if isinstance(value, Text) else Text(value, {}, plain=True)
                 for key, value in nested.items()}, plain=bool(data.get("plain")))


def marked_msgids(text) -> list[str]:
    """The catalogue msgids a message needs: its own unless plain, then its nested fields'."""
    if not isinstance(text, Text):
        return []
    own = [] if text.plain else [text.msgid]
    return own + [m for nested in text.nested.values() for m in marked_msgids(nested)]


@functools.lru_cache(maxsize=None)
def catalogue(lang: str, domain: str = EXERCISES_DOMAIN) -> dict[str, str]:
    """msgid -> msgstr of the current (translated, not fuzzy) entries of ``translations/<lang>/<domain>.po``."""
    import polib

    path = TRANSLATIONS / lang / f"{domain}.po"
    if lang == ENGLISH or not path.exists():
        return {}
    return {e.msgid: e.msgstr for e in polib.pofile(str(path)).translated_entries()}


def render(msgid: str, rendered: dict[str, str], lang: str | None = None) -> str:
    """The message in ``lang`` (default: :func:`language`); English where the catalogue has no translation."""
    lang = normalise(lang) if lang else language()
    template = msgid if lang == ENGLISH else catalogue(lang).get(msgid, msgid)
    return fill(template, rendered)


def localized(text: str, lang: str | None = None) -> str:
    """A :class:`Text` in ``lang``; an unmarked ``str`` as it is, in every language."""
    return text.render(lang) if isinstance(text, Text) else text


def width(text: str) -> int:
    """The columns ``text`` takes in a terminal or a notebook's monospace output: 2 per wide (CJK) character."""
    return sum(2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in text)


AUTO = "auto"  # a Cell width: as wide as the widest cell of its column, in the language shown


@dataclass(frozen=True)
class Cell:
    """Part of a :class:`Lines` row: a message (:class:`Text`, translated) or a ``str`` (kept as it is), padded to
    ``width`` columns (an int, :data:`AUTO`, or None for no padding), ``align`` ``<`` (left) or ``>`` (right)."""

    text: str
    width: int | str | None = None
    align: str = "<"


class Lines:
    """Lines for the learner (a table, a calculator's figures) whose words are messages: shown in the kernel's
    language, padded by display width so a Chinese table stays aligned, and saved with every cell's msgid and fields
    (under :data:`MIME`, kind ``lines``) so the Chinese build renders a saved English output in Chinese.

    Example::

        >>> rows = [[Cell(_("total"), 8), Cell("1.9", 6, ">")]]
        >>> Lines(rows).render("en"), Lines(rows).render("zh_CN")
        ('total      1.9', '总计       1.9')
    """

    def __init__(self, rows):
        self.rows = [[cell if isinstance(cell, Cell) else Cell(cell) for cell in row] for row in rows]

    def render(self, lang: str | None = None) -> str:
        shown = [[localized(cell.text, lang) for cell in row] for row in self.rows]
        auto: dict[int, int] = {}
        for row, texts in zip(self.rows, shown):
            for i, (cell, text) in enumerate(zip(row, texts)):
                if cell.width == AUTO:
                    auto[i] = max(auto.get(i, 0), width(text))
        out = []
        for row, texts in zip(self.rows, shown):
            parts = []
            for i, (cell, text) in enumerate(zip(row, texts)):
                size = auto[i] if cell.width == AUTO else cell.width or 0
                gap = " " * max(0, size - width(text))
                parts.append(gap + text if cell.align == ">" else text + gap)
            out.append("".join(parts).rstrip())
        return "\n".join(out)

    def __str__(self) -> str:
        return self.render()

    def __add__(self, other: "Lines") -> "Lines":
        return Lines(self.rows + other.rows)

    def msgids(self) -> list[str]:
        return [m for row in self.rows for cell in row for m in marked_msgids(cell.text)]

    def to_json(self) -> dict:
        return {"kind": "lines", "rows": [[{"text": as_json(c.text), "width": c.width, "align": c.align} for c in row]
                                          for row in self.rows]}

    @classmethod
    def from_json(cls, data: dict) -> "Lines":
        return cls([[Cell(from_json(c["text"]), c.get("width"), c.get("align", "<")) for c in row]
                    for row in data["rows"]])

    def _repr_mimebundle_(self, **_kwargs):
        return {"text/plain": self.render(), MIME: self.to_json()}


def message(row: str, lang: str | None = None) -> str:
    """A line a validator or the launcher prints (English, from code below the notebook layer) in ``lang``, from
    ``translations/<lang>/messages.po``'s template of it (numbers put back); as it is where the catalogue lacks it."""
    lang = normalise(lang) if lang else language()
    return row if lang == ENGLISH or not row.strip() else localize_row(row, catalogue(lang, MESSAGES_DOMAIN))


def localize_row(row: str, table: dict[str, str]) -> str:
    """``row`` through ``table`` (its template -> the translated template, :func:`number_template`),
    its numbers put back; as it is where the table lacks it."""
    msgid, numbers = number_template(row)
    return fill_numbers(table[msgid], numbers) if msgid in table else row


def say(*values, sep: str = " ") -> None:
    """``print`` for a validator's or the launcher's messages: each printed line in the kernel's language
    (:func:`message`); in English exactly what ``print`` prints."""
    text = sep.join(str(v) for v in values)
    print("\n".join(message(row) for row in text.split("\n")), flush=True)
