"""Claims as checks: check lines are found in executed notebooks, a False one fails the notebook in the course run's
summary and report, and every committed notebook's checks printed True."""
import nbformat
import pytest

from helpers.notebook import checks, report, runner
from helpers.notebook.runner import syllabus

_, CHAPTERS = syllabus()


def _notebook(*lines: str):
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("...")
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="".join(f"{l}\n" for l in lines))]
    nb.cells = [nbformat.v4.new_markdown_cell("[check] prose is not output: False"), cell]
    return nb


def test_claim_prints_one_line_the_tally_reads_back(capsys):
    assert checks.claim("ZeRO-2 holds less than ZeRO-1", 3 < 5, measured="3 vs 5 MiB") is None  # no echo in a cell
    checks.claim("ranks agree", [])
    printed = capsys.readouterr().out
    assert printed.splitlines() == ["[check] ZeRO-2 holds less than ZeRO-1: True   (measured: 3 vs 5 MiB)",
                                    "[check] ranks agree: False"]
    nb = _notebook(*printed.splitlines(), "not a check: True")
    tally = checks.tally(nb)
    assert (tally.passed, tally.failed, str(tally)) == (1, ["ranks agree"], "1/2")


def test_a_false_check_fails_its_notebook_in_the_summary_and_the_report(tmp_path, monkeypatch):
    good, bad = tmp_path / "good.ipynb", tmp_path / "bad.ipynb"
    nbformat.write(_notebook("[check] a: True"), good)
    nbformat.write(_notebook("[check] a: True", "[check] b holds: False"), bad)
    chapters = [runner.Chapter("90", "good.ipynb", "good", 600, {}), runner.Chapter("91", "bad.ipynb", "bad", 600, {})]
    paths = {"good.ipynb": good, "bad.ipynb": bad}

    def execute(chapter, out, *args):  # stands in for papermill: the "executed" notebook is the prepared one
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(paths[chapter.file].read_bytes())

    monkeypatch.setattr(runner, "execute", execute)
    monkeypatch.setattr(runner, "BUILD", tmp_path / "build")
    rows = runner.run_chapters(chapters, in_place=False, profile="smoke", overrides={})
    assert [(r["status"], r["checks"]) for r in rows] == [("ok", "1/1"), ("FAILED", "1/2")]
    assert "b holds" in rows[1]["error"]
    table = runner.summary_table(rows)
    assert "FAILED" in table and "1/2" in table and "b holds" in table
    html = report.render(rows, "smoke", {})
    assert "FAILED" in html and "1/2" in html


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda c: c.id)
def test_every_committed_check_printed_true(chapter):
    tally = checks.tally(nbformat.read(chapter.path, as_version=4))
    assert not tally.failed, f"checks that printed False (the prose above them is wrong): {tally.failed}"
