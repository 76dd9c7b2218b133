"""What a cell shows of a launch is the same on every machine: paths under the course root appear relative to it
(the log files keep them whole); in a saved output (HELPERS_OUTPUT=saved) no progress bar is drawn and the ranks'
lines are grouped by rank, whatever order they arrived in."""
import pytest

from helpers import launch
from helpers.launch.session import course_relative

SCRIPT = "tests/scripts/print_path.py"


def test_course_relative_drops_only_the_course_root():
    root = launch.PROJECT_ROOT
    elsewhere = f"/elsewhere{root}/y"  # holds the root's path, but is not under it
    assert course_relative(f"see {root}/runs/x/rank0.log and {elsewhere}") == \
        f"see runs/x/rank0.log and /elsewhere{root}/y"


@pytest.mark.slow
def test_streamed_lines_show_paths_relative_to_the_course_root(runs_root, capsys):
    run = launch.torchrun(SCRIPT, nproc=2, show="all", timeout=120, stall_timeout=60)
    shown = capsys.readouterr().out
    assert "rank 0 runs tests/scripts/print_path.py" in shown, shown
    assert str(launch.PROJECT_ROOT) not in shown
    assert f"runs {launch.PROJECT_ROOT}/tests/scripts/print_path.py" in run.log(0), "the log keeps the full path"


@pytest.mark.slow
def test_a_failure_message_shows_paths_relative_to_the_course_root(runs_root):
    with pytest.raises(launch.LaunchError) as info:
        launch.torchrun(SCRIPT, nproc=2, env={"FAIL": "1"}, show="none", timeout=120, stall_timeout=60)
    message = str(info.value)
    assert info.value.rank == 1 and "planned failure in tests/scripts/print_path.py" in message, message
    assert str(launch.PROJECT_ROOT) not in message
    assert info.value.run_dir.is_absolute() and info.value.run_dir.exists()


@pytest.mark.slow
@pytest.mark.parametrize("setting, drawn", [("saved", False), ("live", True)])
def test_progress_bar_is_drawn_unless_the_output_is_saved(runs_root, monkeypatch, capsys, setting, drawn):
    monkeypatch.setenv("HELPERS_OUTPUT", setting)
    launch.torchrun("tests/scripts/steps.py", nproc=2, env={"STEPS": "5"}, show="rank0", timeout=120,
                    stall_timeout=60)
    captured = capsys.readouterr()
    assert ("rank 0 steps" in captured.err + captured.out) == drawn


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["saved", "live"])
def test_a_saved_output_groups_the_ranks_lines_by_rank(runs_root, monkeypatch, capsys, setting):
    # rank 1 prints first, then rank 0, then rank 1 again (tests/scripts/interleave.py orders them with barriers):
    # live, that is the order shown; saved, rank 0's lines come first, then rank 1's, then the launcher's
    monkeypatch.setenv("HELPERS_OUTPUT", setting)
    launch.torchrun("tests/scripts/interleave.py", nproc=2, show="all", timeout=120, stall_timeout=60)
    shown = [l for l in capsys.readouterr().out.splitlines() if "interleave" in l or l.startswith("[launcher]")]
    ranks = [l.split()[0] for l in shown if l.startswith("[rank")]
    if setting == "saved":
        assert ranks == ["[rank0]", "[rank0]", "[rank1]", "[rank1]", "[rank1]"], shown
        last_rank_line = max(i for i, l in enumerate(shown) if l.startswith("[rank"))
        assert all(i > last_rank_line for i, l in enumerate(shown) if l.startswith("[launcher]")), shown
    else:
        assert ranks == ["[rank1]", "[rank0]", "[rank0]", "[rank1]", "[rank1]"], shown
