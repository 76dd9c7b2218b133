"""The lesson listings of course scripts find every line they promise, and refuse a marker that matches nothing."""
import pytest

from helpers.notebook.scripts import lesson_lines

DDP_LESSON = ("init_process_group(", "DistributedSampler(", "set_epoch(", "DDP(", "loss.backward()",
              "save_atomic(model.module", "dist.barrier()", "destroy_process_group()", "end_rank(")


def test_every_marker_of_the_ddp_lesson_finds_its_line():
    found = lesson_lines("ddp_cifar10.py", DDP_LESSON)
    assert all(any(m in line for _n, line in found) for m in DDP_LESSON)
    assert [n for n, _l in found] == sorted(n for n, _l in found)


def test_a_marker_that_matches_nothing_is_an_error_naming_it():
    # the marker notebook 02 used after the script's save_atomically( became save_atomic(: it silently dropped a line
    with pytest.raises(ValueError, match="save_atomically"):
        lesson_lines("ddp_cifar10.py", ("DDP(", "save_atomically(model.module"))


def test_comments_do_not_count_as_the_line():
    # "save_atomic:" appears in a comment of ddp_cifar10.py, and the import line names it too; only code lines match
    found = lesson_lines("ddp_cifar10.py", ("save_atomic(model.module",))
    assert len(found) == 1 and found[0][1].startswith("save_atomic(")


def test_the_whole_script_is_shown_with_its_lesson_lines_marked():
    from helpers.notebook.scripts import COURSE, MARK, show_script

    listing = show_script("ddp_cifar10.py", ("DDP(", "set_epoch("))
    text = repr(listing).splitlines()
    source = (COURSE / "ddp_cifar10.py").read_text().splitlines()
    assert len(text) == 1 + len(source)  # a title, then every line of the file
    marked = [line for line in text[1:] if line.startswith(">")]
    assert len(marked) == 2 and any("DDP(" in m for m in marked) and any("set_epoch(" in m for m in marked)
    html = listing._repr_html_()
    assert html.count(f"background-color: {MARK}") == 2  # Pygments highlights exactly the marked lines
    with pytest.raises(ValueError, match="nothing_like_this"):
        show_script("ddp_cifar10.py", ("nothing_like_this(",))


def test_the_diff_between_two_lessons_shows_what_changed():
    from helpers.notebook.scripts import script_diff, show_diff

    diff = script_diff("ddp_tuning.py", "ds_tuning.py")
    assert any(line.startswith("-") and "DDP(" in line for line in diff)
    assert any(line.startswith("+") and "deepspeed.initialize(" in line for line in diff)
    assert not any(line.startswith(("---", "+++")) for line in diff)
    assert script_diff("ddp_tuning.py", "ddp_tuning.py") == []
    title = repr(show_diff("ddp_tuning.py", "ds_tuning.py")).splitlines()[0]
    assert f"{sum(l.startswith('-') for l in diff)} lines out" in title
