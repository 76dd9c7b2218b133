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
import string
from pathlib import Path

ENGLISH = "en"
CHINESE = "zh_CN"
LANGUAGES = (ENGLISH, CHINESE)
MIME = "application/vnd.dtfz.message+json"  # msgid and fields of a message output, for the Chinese build
TRANSLATIONS = Path(__file__).resolve().parents[2] / "translations"
EXERCISES_DOMAIN = "exercises"
CHECKS_DOMAIN = "checks"  # the check lines' sentences (helpers.notebook.checks.template)
MESSAGES_DOMAIN = "messages"  # lines printed by cells tagged zh-messages (helpers.notebook.translate)

_ALIASES = {"en": ENGLISH, "en_us": ENGLISH, "en_gb": ENGLISH, "zh": CHINESE, "zh_cn": CHINESE, "zh_hans": CHINESE}


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
    """An English message (``str`` value) that can also be shown in another language; see :func:`_`."""

    msgid: str
    rendered: dict[str, str]

    def __new__(cls, msgid: str, rendered: dict[str, str]):
        obj = super().__new__(cls, fill(msgid, rendered))
        obj.msgid, obj.rendered = msgid, dict(rendered)
        return obj

    def render(self, lang: str | None = None) -> str:
        return render(self.msgid, self.rendered, lang)

    def to_json(self) -> dict:
        return {"msgid": self.msgid, "fields": self.rendered}


def _(msgid: str, **values) -> Text:
    """Mark ``msgid`` for translation and fill its fields from ``values`` (``{name}``, ``{name!r}``, ``{n:.1f}``)."""
    rendered, names = {}, set()
    for key, name, conversion, spec in fields(msgid):
        value = values[name]
        if conversion == "r":
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
    return Text(msgid, rendered)


def as_json(text: str) -> dict:
    """A message as stored under :data:`MIME`; a plain ``str`` is its own msgid (it is then not translated)."""
    return text.to_json() if isinstance(text, Text) else {"msgid": text, "fields": {}, "plain": True}


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
