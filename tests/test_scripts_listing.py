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
