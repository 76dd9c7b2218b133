"""launch.python runs a script as `python script.py` in a terminal would, bounded by a timeout, and leaves nothing
running; with it, the blog's self-relaunching __main__ (course/pitfall_self_relaunch.py) is shown doing what notebook
02 says it does."""
import re

import psutil
import pytest

from helpers import launch
from helpers.launch import PROJECT_ROOT as ROOT


def test_bad_input_is_refused_before_anything_starts(runs_root):
    with pytest.raises(FileNotFoundError, match="no such script"):
        launch.python("course/no_such_script.py", timeout=10)
    with pytest.raises(ValueError, match="timeout"):
        launch.python("course/pitfall_self_relaunch.py", timeout=None)


@pytest.mark.slow
def test_timeout_kills_the_script_and_what_it_started(runs_root):
    run = launch.python("tests/scripts/spawn_sleeper.py", timeout=3)
    assert run.timed_out and run.returncode != 0
    child = int(re.search(r"child (\d+)", run.output).group(1))
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
    assert run.duration_s < 60 / 2  # the 3 s timeout ended it, not the script's minute of sleep
    assert (run.run_dir / "output.log").read_text() == run.output


@pytest.mark.slow
def test_a_slow_copy_in_the_last_generation_still_reports_the_cap(runs_root, tmp_path):
    """The fault injected: one copy of generation 2 lags a second behind its sibling (a loaded machine). Capped
    copies exit 0, so their torchrun waits for both and every copy says it reached the cap. (With a failing exit
    code, torchrun stopped the lagging sibling first and only 1 of the 4 lines appeared.)"""
    source = (ROOT / "course" / "pitfall_self_relaunch.py").read_text()
    cap = '    if generation >= int(os.environ.get("RELAUNCH_CAP", "2")):\n'
    assert source.count(cap) == 1
    lagging = source.replace(cap, cap + '        import time; time.sleep(1.0 if os.environ.get("RANK") == "1" else 0)\n')
    script = tmp_path / "lagging_relaunch.py"
    script.write_text(lagging)
    run = launch.python(script, timeout=120, name="self_relaunch_lag",
                        env={"BLOG_PORT": launch.free_port(), "NPROC": 2, "OMP_NUM_THREADS": 1})
    assert not run.timed_out and run.returncode == 0
    assert len(re.findall(r"\[generation 2, RANK 1\] safety cap reached", run.output)) == 2, run.output
    assert len(re.findall(r"\[generation 2[^\]]*\] safety cap reached", run.output)) == 4
