"""What a learner sees: JupyterLab in a real browser opens every notebook on the course kernel, runs notebook 00
without an error, and the ZeRO memory calculator answers its "parameters (B)" slider; a Chinese JupyterLab opens
a Chinese notebook with its Chinese heading and the same working widget, its labels and table in Chinese.

Drives Debian's Chromium (/usr/bin/chromium) with Playwright against a throwaway JupyterLab on a copy of the course.
Screenshots go to build/browser/. Skipped, with the reason, only where Chromium or Playwright is missing.
"""
import re
import time
from pathlib import Path

import nbformat
import pytest

from helpers.notebook import i18n
from helpers.notebook.runner import BUILD, syllabus

from browser.lab import CHROMIUM, CHROMIUM_ARGS, JupyterLab, copy_course, make_notebook

if not CHROMIUM.exists():
    pytest.skip(f"browser test: Debian's Chromium is not installed at {CHROMIUM} (apt-get install chromium)",
                allow_module_level=True)
pytest.importorskip("playwright.sync_api", reason="browser test: the playwright package is not importable "
                    "(pip install playwright; its wheel bundles the driver, no `playwright install` needed)")

from browser.notebook_page import EXECUTED, NotebookPage  # noqa: E402

pytestmark = [pytest.mark.browser, pytest.mark.slow]

SHOTS = BUILD / "browser"
KERNEL_NAMES = ("Python (distributed course)", "dtfz")
CALCULATOR_TAG = "zero-calculator"
_, CHAPTERS = syllabus()


def _tags(cell) -> list:
    return cell.get("metadata", {}).get("tags", [])


def _serve(tmp_path_factory, name: str, locale: str | None = None):
    """A JupyterLab on a fresh copy of the course, for one test module; stopped however the tests end."""
    tmp = tmp_path_factory.mktemp(name)
    root = tmp / "course"
    root.mkdir()
    copy_course(root)
    server = JupyterLab(root, tmp / "lab-state", tmp / "jupyter-lab.log", locale=locale)
    try:
        server.start()
        yield server
    finally:
        server.stop()  # kernels first, then the server; leftovers are killed by pid


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    yield from _serve(tmp_path_factory, "browser")


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright
    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.set_default_timeout(60_000)
    try:
        yield page
    finally:
        context.close()


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda c: c.id)
def test_notebook_renders_with_the_course_kernel(lab, page, chapter):
    committed = nbformat.read(chapter.path, as_version=4)
    view = NotebookPage(page, lab, f"notebooks/{chapter.file}")
    try:
        start = time.monotonic()
        view.open()
        view.screenshot(SHOTS / f"{Path(chapter.file).stem}.png")
        assert view.cells.count() == len(committed["cells"])
        assert view.cells.first.is_visible()
        assert view.kernel_display_name() in KERNEL_NAMES
        assert view.session()["kernel"]["name"] == "dtfz", "JupyterLab started another kernel than the course's"
        with_outputs = sum(bool(c.get("outputs")) for c in committed["cells"])
        assert page.locator(".jp-NotebookPanel .jp-OutputArea-output").count() >= with_outputs
        print(f"\n{chapter.file}: rendered, kernel up in {time.monotonic() - start:.1f}s")
    finally:
        view.shutdown_kernel()


def test_notebook_00_runs_end_to_end_without_errors(lab, page):
    chapter = next(c for c in CHAPTERS if c.id == "00")
    view = NotebookPage(page, lab, f"notebooks/{chapter.file}")
    try:
        view.open()
        seconds = view.run_all(timeout_s=chapter.timeout_s + 120)
        view.cells.last.scroll_into_view_if_needed()
        view.screenshot(SHOTS / f"{Path(chapter.file).stem}-run-all.png")
        prompts = view.prompts()
        assert all(EXECUTED.match(p) for p in prompts), f"cells not executed: {prompts}"
        assert not view.tracebacks_on_screen()
        saved = view.save()
        code = [c for c in saved["cells"] if c["cell_type"] == "code"]
        errors = [f"cell {i}: {o.get('ename')}: {o.get('evalue')}" for i, c in enumerate(code)
                  for o in c.get("outputs", []) if o["output_type"] == "error"]
        assert not errors
        assert all(c.get("execution_count") for c in code)
        print(f"\n{chapter.file}: Run All Cells finished in {seconds:.0f}s in the browser, no errors")
    finally:
        view.shutdown_kernel()


def _calculator_cells(root: Path) -> tuple[str, list[int]]:
    """The notebook and cell indices to run: the course's cells tagged zero-calculator (after its parameters
    cell), or, until a notebook has them, a one-cell notebook written for this test."""
    for chapter in CHAPTERS:
        cells = nbformat.read(chapter.path, as_version=4).cells
        tagged = [i for i, c in enumerate(cells) if CALCULATOR_TAG in _tags(c)]
        if tagged:
            parameters = [i for i, c in enumerate(cells) if "parameters" in _tags(c)]
            return f"notebooks/{chapter.file}", sorted(set(parameters + tagged))
    make_notebook(root / "zero_calculator_check.ipynb",
                  [("from helpers.notebook.widgets import zero_calculator\nzero_calculator()", [CALCULATOR_TAG])])
    return "zero_calculator_check.ipynb", [0]


def _settled_text(locator, differing_from: str, timeout_s: float, quiet_s: float = 1.5) -> str:
    """The locator's text once it differs from ``differing_from`` and has stopped changing for ``quiet_s``
    (every key press is a round trip to the kernel; read the table after the last one)."""
    deadline = time.monotonic() + timeout_s
    text, since = locator.inner_text(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = locator.inner_text()
        if now != text:
            text, since = now, time.monotonic()
        elif text != differing_from and time.monotonic() - since >= quiet_s:
            break
    return text


def _figures(text: str, lang: str = "en") -> tuple[float, float]:
    """(parameters in billions, paper total per device in GB) as the calculator's table shows them in ``lang``."""
    params, total = (re.escape(i18n._(label).render(lang)) for label in ("parameters", "total"))
    count, unit = re.search(rf"([\d.]+)([BM]) {params}", text).groups()
    total = re.search(rf"^{total}\s+([\d.]+)", text, re.M).group(1)
    return float(count) / (1000 if unit == "M" else 1), float(total)


def _drive_calculator(view, page, cells, shot: str, lang: str = "en") -> tuple[float, float, float, float]:
    """Run the calculator's cells, press the "parameters (B)" slider (its label in ``lang``, the kernel's language)
    six steps right; (B before, B after, GB before, GB after) once its table has changed and settled."""
    view.open()
    view.run_cells(cells, timeout_s=300)
    calculator = page.locator(".zero-calculator").first
    result = page.locator(".zero-calculator-result").first
    result.wait_for(state="visible")
    calculator.scroll_into_view_if_needed()
    before = result.inner_text()
    view.screenshot(SHOTS / f"{shot}-before.png", element=calculator)

    label = i18n._("parameters (B)").render(lang)
    slider = calculator.locator(".widget-slider", has=page.locator("label", has_text=label))
    slider.locator(".noUi-handle").focus()
    for _ in range(6):  # each step is 0.05 in log10: x1.12 per press, about x2 in all
        page.keyboard.press("ArrowRight")
    after = _settled_text(result, differing_from=before, timeout_s=30)
    view.screenshot(SHOTS / f"{shot}-after.png", element=calculator)

    assert after != before, "the calculator's table did not change when the slider moved"
    (params_before, total_before), (params_after, total_after) = _figures(before, lang), _figures(after, lang)
    assert params_after > params_before
    assert total_after > total_before
    return params_before, params_after, total_before, total_after


def test_zero_calculator_follows_the_parameters_slider(lab, page):
    path, cells = _calculator_cells(Path(lab.root_dir))
    view = NotebookPage(page, lab, path)
    try:
        p0, p1, t0, t1 = _drive_calculator(view, page, cells, "zero-calculator")
        print(f"\n{path}: slider {p0:g}B -> {p1:g}B parameters, paper total per device {t0:g} -> {t1:g} GB")
    finally:
        view.shutdown_kernel()


@pytest.fixture(scope="module")
def lab_zh(tmp_path_factory):
    """A second server whose interface is Chinese: the setting `make lab-zh` writes, the installed language pack."""
    yield from _serve(tmp_path_factory, "browser-zh", locale="zh_CN")


def test_a_chinese_notebook_opens_in_chinese_jupyterlab_and_its_widget_works(lab_zh, page):
    """notebooks/zh/: the Chinese heading on screen, JupyterLab's own menus in Chinese, the kernel started in the
    notebook's folder, and the ZeRO calculator answering its slider there."""
    chapter = next(c for c in CHAPTERS if any(CALCULATOR_TAG in _tags(x) for x in nbformat.read(c.path, 4).cells))
    path = f"notebooks/zh/{chapter.file}"
    cells = nbformat.read(Path(lab_zh.root_dir) / path, 4).cells
    wanted = sorted(i for i, c in enumerate(cells) if {"parameters", CALCULATOR_TAG} & set(_tags(c)))
    heading = cells[0].source.splitlines()[0].lstrip("# ").strip()
    assert re.search(r"[\u4e00-\u9fff]", heading), heading
    view = NotebookPage(page, lab_zh, path)
    try:
        p0, p1, t0, t1 = _drive_calculator(view, page, wanted, "zh-zero-calculator", "zh_CN")
        assert page.locator(".jp-MarkdownOutput h1").first.inner_text().strip().rstrip("¶").strip() == heading
        assert page.locator(".lm-MenuBar-itemLabel", has_text=re.compile("^编辑$")).count() == 1, \
            "JupyterLab's menus are not in Chinese"
        view.screenshot(SHOTS / "zh-notebook.png")
        print(f"\n{path}: heading {heading!r}, slider {p0:g}B -> {p1:g}B, total {t0:g} -> {t1:g} GB")
    finally:
        view.shutdown_kernel()
