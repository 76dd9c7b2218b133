"""Every chapter that has a write-the-code exercise tags it, and the cell hands the learner's code to a checker that
launches it (helpers.notebook.exercises.write), never to one that only reads it."""
import ast
import json
from pathlib import Path

import pytest

from helpers.notebook.exercises import write

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
# 04 (the DDP vs DeepSpeed comparison) has none yet; 00 is the environment check
WITH_WRITE_EXERCISE = ("01", "02", "03", "04", "05", "06", "07", "08", "09", "10", "11")


def _write_cells(stem: str) -> list[str]:
    nb = json.loads(next(NOTEBOOKS.glob(f"{stem}_*.ipynb")).read_text())
    return ["".join(c["source"]) for c in nb["cells"]
            if c["cell_type"] == "code" and "exercise-write" in c.get("metadata", {}).get("tags", [])]


@pytest.mark.parametrize("stem", WITH_WRITE_EXERCISE)
def test_the_chapter_has_a_tagged_exercise_whose_checker_launches_the_code(stem):
    cells = _write_cells(stem)
    assert cells, f"notebook {stem} has no cell tagged exercise-write"
    for source in cells:
        calls = [n.func.attr for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call)
                 and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name) and n.func.value.id == "write"
                 and n.func.attr.startswith("check_")]
        assert calls and all(hasattr(write, c) for c in calls), source


@pytest.mark.parametrize("stem", WITH_WRITE_EXERCISE)
def test_no_solution_is_printed_by_default(stem):
    for source in _write_cells(stem):
        live = [line for line in source.splitlines() if "write.solution(" in line and not line.lstrip().startswith("#")]
        assert not live, live
