"""The committed notebooks are in a state nbval can validate and an instructor can trust."""
import re

import nbformat
import pytest

from helpers.notebook.runner import NOTEBOOKS, WIDGET_VIEW, strip_volatile, syllabus

_, CHAPTERS = syllabus()
IGNORE_MARKERS = ("NBVAL_IGNORE_OUTPUT", "NBVAL_SKIP", "NBVAL_RAISES_EXCEPTION")
IGNORE_TAGS = ("nbval-ignore-output", "nbval-skip", "raises-exception")


def _code_cells(nb):
    return [c for c in nb["cells"] if c["cell_type"] == "code" and "".join(c["source"]).strip()]


def _compared(cell) -> bool:
    tags = cell.get("metadata", {}).get("tags", [])
    first_lines = "".join(cell["source"]).splitlines()[:3]
    return not any(t in tags for t in IGNORE_TAGS) and not any(
        line.strip().lstrip("#").strip().startswith(IGNORE_MARKERS) for line in first_lines)


def _load(chapter):
    return nbformat.read(chapter.path, as_version=4)


def test_syllabus_lists_exactly_the_notebooks_on_disk():
    on_disk = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))
    assert sorted(c.file for c in CHAPTERS) == on_disk
    assert sorted(p.name for p in NOTEBOOKS.iterdir() if not p.name.startswith(".")) == on_disk + ["zh"], \
        "notebooks/ holds the notebooks and the Chinese edition's folder, nothing else (a file browser shows all)"
    assert [c.id for c in CHAPTERS] == sorted(c.id for c in CHAPTERS), "syllabus order is notebook order"


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda c: c.id)
def test_at_least_a_third_of_code_cells_are_compared_by_nbval(chapter):
    cells = _code_cells(_load(chapter))
    compared = [c for c in cells if _compared(c)]
    assert len(compared) * 3 >= len(cells), f"{len(compared)} of {len(cells)} code cells compared"


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda c: c.id)
def test_notebook_is_committed_with_outputs_and_no_errors(chapter):
    nb = _load(chapter)
    cells = _code_cells(nb)
    assert any(c.get("outputs") for c in cells), "run `make regen` before committing"
    unexecuted = [i for i, c in enumerate(cells) if c.get("execution_count") is None]
    assert not unexecuted, f"code cells {unexecuted} were never executed: outputs must come from `make regen`"
    errors = [o for c in cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, f"committed error output: {errors[0].get('ename')}: {errors[0].get('evalue')}"


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda c: c.id)
def test_notebook_has_parameters_cell_and_course_kernel(chapter):
    nb = _load(chapter)
    tags = [c.get("metadata", {}).get("tags", []) for c in nb["cells"]]
    assert sum("parameters" in t for t in tags) == 1, "exactly one papermill parameters cell"
    assert not any("injected-parameters" in t for t in tags), "regen must strip papermill's injected cell"
    assert nb["metadata"]["kernelspec"]["name"] == "dtfz"
    assert "papermill" not in nb["metadata"], "volatile papermill metadata must be stripped"
    recorded = nb["metadata"]["course"]["environment"]
    assert recorded["notebook"] == chapter.file and recorded["status"] == "ok", "outputs come from a clean regen"
    assert {"torch", "deepspeed", "papermill"} <= set(recorded["packages"])


# An absolute path of the machine that ran the regen: under a root directory that holds checkouts, homes or temporary
# files (URLs, "//host/...", and relative paths such as runs/x or course/y do not match).
MACHINE_PATH = re.compile(r"(?<![\w.:/~])/(?:work|home|root|tmp|Users|opt|usr|srv|mnt|var|private)/[\w.\-/]+")


def _output_texts(nb):
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                yield i, out.get("text", "")
            elif out.get("output_type") == "error":
                yield i, "\n".join(out.get("traceback", []))
            for kind, value in out.get("data", {}).items():
                if kind.startswith("text/"):
                    yield i, "".join(value) if isinstance(value, list) else value


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda c: c.id)
def test_committed_outputs_hold_no_absolute_path(chapter):
    found = [(i, m) for i, text in _output_texts(_load(chapter)) for m in MACHINE_PATH.findall(text)]
    assert not found, f"machine paths in committed outputs (cell, path): {found[:5]}"


# a number in scientific notation with a negative exponent: a rounding gap or a floor, which the CPU's float kernels
# decide (nb10's fp32 - fp64 gaps were 9e-09 on one machine and 2e-07 on another)
ROUNDING_SIZED = re.compile(r"(?<![\w.])\d(?:\.\d+)?e-\d+")
# lines that print fixed constants of the float formats (chapter 05: torch.finfo, and 1e-8 cast to fp16 / bf16), the
# same on every machine
FIXED_CONSTANTS = ("largest", "in fp16:")


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda c: c.id)
def test_compared_outputs_hold_no_rounding_sized_number_outside_a_measured_part(chapter):
    # nbval compares these cells on every machine, and its sanitizer masks only "(measured: ...)": a gap or floor shown
    # elsewhere fails CI on the next machine (it did, twice: nb12's parity table, nb10's per-step gaps)
    nb = _load(chapter)
    found = [(i, line.strip()[:100]) for i, text in _output_texts(nb) if _compared(nb.cells[i])
             for line in re.sub(r"\(measured: [^\n]*\)", "", text).splitlines()
             if ROUNDING_SIZED.search(line) and not any(c in line for c in FIXED_CONSTANTS)]
    assert not found, f"show these in an nbval-ignore-output cell or a claim's measured part (cell, line): {found[:5]}"


def test_rounding_sized_pattern_finds_gaps_and_spares_names():
    assert ROUNDING_SIZED.findall("gaps 9e-09, 3.1e-07 and 2e-3; lr 1e-4 (bound 4.0e-6)") == \
        ["9e-09", "3.1e-07", "2e-3", "1e-4", "4.0e-6"]
    assert not ROUNDING_SIZED.findall("fp32, ZeRO-3, sha256 1e3f, 1e9 elements, torch 2.14.1")


def test_machine_path_pattern_finds_paths_and_spares_urls():
    assert MACHINE_PATH.findall("saved to /work/main/runs/x.pt and /home/me/.venv/lib") == \
        ["/work/main/runs/x.pt", "/home/me/.venv/lib"]
    assert not MACHINE_PATH.findall("see https://pytorch.org/docs/stable/x.html, runs/02/x, ~/data, course/a.py")


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda c: c.id)
def test_committed_notebook_stores_no_widget_state(chapter):
    # widget model ids are new on every run: stored, they rewrite the notebook on every regen for nothing
    nb = _load(chapter)
    assert "widgets" not in nb.metadata
    views = [i for i, c in enumerate(nb.cells) for o in c.get("outputs", []) if WIDGET_VIEW in o.get("data", {})]
    assert not views, f"cells whose output points at a widget model that is not stored: {views}"


def test_strip_volatile_keeps_a_widgets_text_and_drops_its_model():
    nb = nbformat.v4.new_notebook(metadata={"widgets": {"state": {"abc": {}}}, "papermill": {"duration": 1.0}})
    cell = nbformat.v4.new_code_cell("builder", metadata={"execution": {"iopub.status.idle": "now"}, "tags": []})
    cell.outputs = [nbformat.v4.new_output("display_data", data={WIDGET_VIEW: {"model_id": "abc"},
                                                                 "text/plain": "ConfigBuilder(stage=2)"})]
    nb.cells = [cell]
    strip_volatile(nb)
    assert "widgets" not in nb.metadata and "papermill" not in nb.metadata
    assert nb.cells[0].outputs[0]["data"] == {"text/plain": "ConfigBuilder(stage=2)"}
    assert nb.cells[0].metadata == {}


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda c: c.id)
def test_every_lesson_cell_is_short(chapter):
    # a cell a learner reads is a launch, a table, a plot or a snippet; claim logic lives in helpers/notebook/lessons
    from helpers.notebook.lesson_stats import MAX_CELL_LINES, MAX_EXERCISE_LINES, long_cells

    assert long_cells(_load(chapter)) == [], \
        f"code cells over {MAX_CELL_LINES} non-blank lines ({MAX_EXERCISE_LINES} for exercise-write): move their logic into the chapter's lesson module"


def test_nbval_stops_a_notebook_that_runs_past_its_syllabus_timeout(monkeypatch):
    """tests/nbval_timeouts.py: a notebook's cells are timed as nbval runs them; once their sum passes the notebook's
    timeout_s, its next cell fails at once, naming the limit, and other notebooks are not affected."""
    import types

    import nbval_timeouts as plugin

    chapter = CHAPTERS[0]
    cell = types.SimpleNamespace(path=chapter.path)
    other = types.SimpleNamespace(path=CHAPTERS[1].path)
    monkeypatch.setattr(plugin, "SPENT", {})
    clock = iter([0.0, chapter.timeout_s - 1.0, 100.0, 102.5])
    monkeypatch.setattr(plugin.time, "monotonic", lambda: next(clock))
    for _ in range(2):  # two cells: timeout_s - 1 seconds, then 2.5 more
        plugin.pytest_runtest_setup(cell)
        wrapper = plugin.pytest_runtest_call(cell)
        next(wrapper)
        with pytest.raises(StopIteration):
            next(wrapper)
    assert plugin.SPENT[chapter.file] == pytest.approx(chapter.timeout_s + 1.5)
    with pytest.raises(pytest.fail.Exception, match=f"past its syllabus timeout of {chapter.timeout_s} s"):
        plugin.pytest_runtest_setup(cell)
    plugin.pytest_runtest_setup(other)  # the next notebook starts as usual


def _committed_seconds(chapter) -> float:
    return _load(chapter).metadata["course"]["environment"]["seconds"]


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda c: c.id)
def test_each_notebook_was_regenerated_within_its_budget(chapter):
    """`make regen` records how long each notebook took (smoke profile, this kind of 2-core machine): a chapter that
    outgrows its budget fails here when it is regenerated, not as a slow CI."""
    env = _load(chapter).metadata["course"]["environment"]
    assert env["profile"] == "smoke" and env["gpus"] == 0, "commit outputs of the smoke profile on a CPU"
    assert chapter.timeout_s >= chapter.budget_s, "the hang guard sits above the budget"
    assert env["seconds"] <= chapter.budget_s, \
        f"{chapter.file} took {env['seconds']:.0f} s in `make regen`; its budget is {chapter.budget_s} s"


def test_all_notebooks_were_regenerated_within_the_total_budget():
    settings, _ = syllabus()
    total = sum(_committed_seconds(c) for c in CHAPTERS)
    assert total <= settings["total_budget_s"], \
        f"the notebooks took {total:.0f} s together in `make regen`; the budget is {settings['total_budget_s']} s"
