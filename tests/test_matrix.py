"""`make matrix` (helpers/notebook/matrix.py): the check lines it counts, the runs it plans, what it reports, its exit
status. No kernel starts here: the notebook execution is replaced by one that writes a fixture notebook."""
from pathlib import Path

import nbformat
import pytest
from nbformat import v4

from helpers.notebook import checks, matrix, runner, syllabus
from helpers.notebook.runner import Chapter

ROOT = Path(__file__).resolve().parent.parent


def _stream(text: str, name: str = "stdout"):
    return v4.new_output("stream", name=name, text=text)


def _notebook(*cells, nproc_parameter: bool = True):
    """A notebook with a parameters cell and ``cells``, each a list of outputs (a str is a markdown cell)."""
    nb = v4.new_notebook(metadata={"kernelspec": {"name": "python3", "language": "python", "display_name": "Python 3"},
                                   "language_info": {"name": "python"}})
    params = 'PROFILE = "auto"\n' + ("NPROC = None\n" if nproc_parameter else "TRAIN_SIZE = None\n")
    nb.cells.append(v4.new_code_cell(params, metadata={"tags": ["parameters"]}))
    for outputs in cells:
        if isinstance(outputs, str):
            nb.cells.append(v4.new_markdown_cell(outputs))
        else:
            nb.cells.append(v4.new_code_cell("claim(...)", outputs=outputs))
    return nb


def _executed(nproc: int, *, false_at: int | None = None):
    """What a run at ``nproc`` ranks prints: check lines among others, one of them False at ``false_at`` ranks."""
    return _notebook(
        "The claim below is about [check] lines; `[check] in prose: True` in markdown is no check.",
        [_stream(f"profile smoke: {nproc} ranks\n[check] every rank reported: True\nchecked: True\n"),
         _stream(f"[check] {nproc} ranks run at least 0.9x the samples/s of 1 rank: {nproc != false_at}"
                 "   (measured: 0.52x)\n"),
         v4.new_output("execute_result", data={"text/plain": "'[check] in a result: True'"}, execution_count=1)],
        [_stream("[check] no verdict here\n  [check] indented: True\n[check] almost: Truely\n[check]: True\n"),
         _stream("[check] the loss went down: True\n", name="stderr")],
    )


def test_the_counter_finds_exactly_the_check_lines():
    found = checks.check_lines(_executed(3, false_at=3))
    assert found == [("every rank reported", True),
                     ("3 ranks run at least 0.9x the samples/s of 1 rank", False),
                     ("the loss went down", True)]
    result = matrix.outcome(_executed(3, false_at=3))
    assert (result.passed, result.total, result.failed) == (2, 3, ["3 ranks run at least 0.9x the samples/s of 1 rank"])
    assert result.missing == []


def test_a_check_the_committed_notebook_prints_and_this_run_does_not_is_missing():
    committed = _executed(2)
    committed.cells.append(v4.new_code_cell("", outputs=[_stream("[check] only where nproc > 1: True\n")]))
    # "3 ranks ..." answers the committed "2 ranks ...": numbers in a claim count as equal
    assert matrix.outcome(_executed(3), committed).missing == ["only where nproc > 1"]
    assert matrix.outcome(None, committed).missing == [c for c, _ in checks.check_lines(committed)]


@pytest.fixture
def fixture_course(tmp_path, monkeypatch):
    """Two committed fixture notebooks (one with NPROC, one without) standing in for the syllabus, and an execution
    that writes what a run would print: a False at 3 ranks, a failure in the notebook without NPROC."""
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    nbformat.write(_executed(2), notebooks / "97_ranks.ipynb")
    nbformat.write(_notebook([_stream("[check] fixed ranks: True\n")], nproc_parameter=False),
                   notebooks / "98_fixed.ipynb")
    chapters = [Chapter("97", "97_ranks.ipynb", "ranks", 60, {}), Chapter("98", "98_fixed.ipynb", "fixed", 60, {})]
    monkeypatch.setattr(runner, "NOTEBOOKS", notebooks)  # where the runner executes them
    monkeypatch.setattr(syllabus, "NOTEBOOKS", notebooks)  # where Chapter.path finds them
    monkeypatch.setattr(runner, "syllabus", lambda path=None: ({"kernel": "dtfz"}, chapters))
    monkeypatch.setattr(runner, "environment_record", lambda profile: {"profile": profile})
    calls = []

    def execute(chapter, output, profile, overrides, kernel, cell_timeout):
        calls.append((chapter.id, overrides))
        output.parent.mkdir(parents=True, exist_ok=True)
        if chapter.id == "98":  # papermill writes the notebook up to the failing cell, then raises
            nbformat.write(_notebook(), output)
            raise RuntimeError("PapermillExecutionError: cell 2 raised\nValueError: the fixture failed")
        nbformat.write(_executed(overrides["NPROC"], false_at=3), output)

    monkeypatch.setattr(runner, "execute", execute)
    return chapters, calls, notebooks


def test_the_matrix_passes_NPROC_by_its_notebook_name_and_runs_a_notebook_without_it_once(fixture_course, tmp_path):
    chapters, calls, notebooks = fixture_course
    committed = (notebooks / "97_ranks.ipynb").read_bytes()
    runs, notes = matrix.plan(chapters, [1, 3])
    assert [(r.chapter.id, r.nproc, r.folder) for r in runs] == [("97", 1, "1"), ("97", 3, "3"), ("98", None, "once")]
    assert notes == ["98_fixed.ipynb: its parameters cell has no NPROC, so it runs once at its own rank counts"]
    rows = matrix.run(runs, profile="smoke", out_root=tmp_path / "matrix")
    assert calls == [("97", {"NPROC": 1}), ("97", {"NPROC": 3}), ("98", {})]
    assert [Path(r["output"]).relative_to(tmp_path / "matrix").as_posix() for r in rows] == [
        "1/97_ranks.ipynb", "3/97_ranks.ipynb", "once/98_fixed.ipynb"]
    assert (notebooks / "97_ranks.ipynb").read_bytes() == committed, "never in place"
    assert [(r["status"], r["checks"]) for r in rows] == [("ok", "3/3"), ("FAILED", "2/3"), ("FAILED", "0/0")]


def test_false_checks_and_a_failed_notebook_are_reported_and_fail_the_matrix(fixture_course, tmp_path, capsys):
    assert matrix.main(["--out", str(tmp_path / "matrix")]) == 1
    out = capsys.readouterr().out
    table = out[out.index("notebook "):]
    assert "False: 3 ranks run at least 0.9x the samples/s of 1 rank" in table
    assert "False: 1 ranks" not in table and "False: 2 ranks" not in table
    assert "98_fixed.ipynb   once  FAILED" in table
    assert "error: ValueError: the fixture failed" in table
    assert "missing: fixed ranks" in table, "a check the failed notebook never printed"
    assert "note: 98_fixed.ipynb: its parameters cell has no NPROC" in out
    assert (tmp_path / "matrix" / "summary.json").exists()


def test_the_exit_status_is_zero_only_without_a_false_check_or_a_failed_notebook():
    ok = {"status": "ok", "failed": [], "missing": []}
    assert matrix.exit_status([ok, {**ok, "status": "SLOW"}, {**ok, "missing": ["printed only at 2 ranks"]}]) == 0
    assert matrix.exit_status([ok, {**ok, "failed": ["a claim"]}]) == 1
    assert matrix.exit_status([ok, {**ok, "status": "FAILED"}]) == 1


def test_the_course_matrix_runs_every_notebook_and_the_sharding_chapters_at_4_ranks():
    _, chapters = runner.syllabus()
    runs, notes = matrix.plan(chapters)
    counts = {}
    for r in runs:
        counts.setdefault(r.chapter.id, []).append(r.nproc)
    assert set(counts) == {c.id for c in chapters}
    for ch in chapters:
        if matrix.nproc_parameter(ch.path) is None:
            assert counts[ch.id] == [None], f"{ch.file} takes no NPROC: it runs once"
            assert any(n.startswith(ch.file) for n in notes)
        else:
            want = ([1, 2, 4] if ch.id == "13" else [1, 2, 3, 4] if ch.id in {"03", "04", "07", "08", "09", "10", "11", "12"}
                    else [1, 2, 3])  # 13: the degrees that split its 8 experts evenly
            assert counts[ch.id] == want, ch.file
    assert counts["06"] == [None], "06 launches its own rank counts"


def test_make_matrix_is_a_target_of_its_own_outside_make_test():
    makefile = (ROOT / "Makefile").read_text()
    assert "\nmatrix: setup" in makefile and "helpers.notebook.matrix" in makefile
    for target in ("test", "check", "unit", "slow", "nbtest"):
        line = next(line for line in makefile.splitlines() if line.startswith(f"{target}:"))
        assert "matrix" not in line.split("##")[0]
