"""Notebooks the course runner executes (``make course``, ``make regen``, ``python -m helpers run``) talk to their
kernel over Unix sockets in a private folder, not over TCP on 127.0.0.1: nothing else on the machine can reach the
kernel, and ipykernel has no reason to print its warning about an unencrypted TCP kernel with every notebook."""
import subprocess
import sys

import nbformat
import pytest

from helpers.notebook.runner import ROOT

WARNING = "Kernel is running over TCP without encryption"

pytestmark = pytest.mark.slow  # a kernel started for each test

# the runner's own path from a notebook file to an executed one, in a process of its own (whose stderr the kernel's
# log lines go to, as they do to the terminal in `make course`)
EXECUTE = ("import sys; from pathlib import Path; from helpers.notebook import runner; "
           "runner.execute_notebook(Path(sys.argv[1]), Path(sys.argv[2]), parameters={}, kernel='dtfz', "
           "cwd=Path(sys.argv[1]).parent, cell_timeout=60, transport=sys.argv[3])")


def _execute(tmp_path, transport: str) -> tuple[str, str]:
    """(what the notebook printed, the stderr of executing it) over ``transport``."""
    source, output = tmp_path / f"{transport}.ipynb", tmp_path / f"{transport}-out.ipynb"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(6 * 7)")])
    nb.metadata.kernelspec = {"name": "dtfz", "display_name": "Python (distributed course)", "language": "python"}
    nbformat.write(nb, source)
    done = subprocess.run([sys.executable, "-c", EXECUTE, str(source), str(output), transport], cwd=ROOT,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    outputs = nbformat.read(output, as_version=4).cells[0].outputs
    return "".join(o.get("text", "") for o in outputs), done.stderr


def test_the_runners_kernel_prints_no_transport_warning(tmp_path):
    printed, stderr = _execute(tmp_path, "ipc")
    assert printed == "42\n"
    assert WARNING not in stderr, stderr


def test_the_warning_is_what_a_tcp_kernel_prints(tmp_path):
    """The test above can fail: over jupyter_client's default transport the same run prints the warning."""
    printed, stderr = _execute(tmp_path, "tcp")
    assert printed == "42\n"
    assert WARNING in stderr
