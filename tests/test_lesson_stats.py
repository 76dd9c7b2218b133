"""The reading-load counts find the long cells and the words they promise to count."""
import nbformat

from helpers.notebook import lesson_stats


def _nb(*cells):
    nb = nbformat.v4.new_notebook()
    nb.cells = list(cells)
    return nb


def test_a_cell_over_the_limit_is_named_and_the_parameters_cell_is_not_counted():
    long = nbformat.v4.new_code_cell("\n".join(f"x{i} = {i}" for i in range(13)) + "\n\n\n")
    short = nbformat.v4.new_code_cell("a = 1\n\nb = 2")
    params = nbformat.v4.new_code_cell("\n".join(f"P{i} = {i}" for i in range(30)))
    params.metadata["tags"] = ["parameters"]
    nb = _nb(params, long, short, nbformat.v4.new_markdown_cell("Two words\nand three"))
    assert lesson_stats.long_cells(nb) == [(long.id, 13)]
    assert lesson_stats.code_lines(short) == 2
    assert [c.id for c in lesson_stats.lesson_cells(nb)] == [long.id, short.id]
    assert lesson_stats.markdown_words(nb) == 4


def test_exactly_the_limit_is_allowed():
    cell = nbformat.v4.new_code_cell("\n".join(f"x{i} = {i}" for i in range(lesson_stats.MAX_CELL_LINES)))
    assert lesson_stats.long_cells(_nb(cell)) == []


def test_a_write_the_code_cell_has_the_longer_limit():
    body = "\n".join(f"x{i} = {i}" for i in range(lesson_stats.MAX_CELL_LINES + 1))
    cell = nbformat.v4.new_code_cell(body)
    assert lesson_stats.long_cells(_nb(cell)) == [(cell.id, lesson_stats.MAX_CELL_LINES + 1)]
    cell.metadata["tags"] = ["exercise-write"]
    assert lesson_stats.long_cells(_nb(cell)) == []
    cell.source = "\n".join(f"x{i} = {i}" for i in range(lesson_stats.MAX_EXERCISE_LINES + 1))
    assert lesson_stats.long_cells(_nb(cell)) == [(cell.id, lesson_stats.MAX_EXERCISE_LINES + 1)]
