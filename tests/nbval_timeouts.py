"""A pytest plugin for `make nbtest`: each notebook is held to its own syllabus timeout (course/syllabus.yml,
``timeout_s``) under nbval, as `make course` holds it under papermill.

nbval itself knows only a per-cell timeout (the Makefile's HANG_S). Here the seconds of a notebook's cells are added
up as they run; once they pass the notebook's timeout, its remaining cells fail at once, naming the notebook and its
limit, instead of running on (the next notebook starts as usual).
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from helpers.notebook.runner import syllabus

LIMITS = {c.file: c.timeout_s for c in syllabus()[1]}
SPENT: dict[str, float] = {}


def _notebook(item) -> str | None:
    name = Path(str(item.path)).name
    return name if name in LIMITS else None


def pytest_runtest_setup(item):
    name = _notebook(item)
    if name is not None and SPENT.get(name, 0.0) > LIMITS[name]:
        pytest.fail(f"{name} has run {SPENT[name]:.0f} s under nbval, past its syllabus timeout of {LIMITS[name]} s: "
                    f"its remaining cells are not run", pytrace=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    start = time.monotonic()
    yield
    name = _notebook(item)
    if name is not None:
        SPENT[name] = SPENT.get(name, 0.0) + time.monotonic() - start
