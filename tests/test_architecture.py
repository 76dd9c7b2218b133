"""The line through helpers/, enforced: import-linter's contracts in pyproject.toml hold for the tree as it is, and
each one breaks -- naming the offending import -- when a forbidden import is added to a copy of the tree."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(cwd: Path) -> subprocess.CompletedProcess:
    # lint-imports puts its working directory first on sys.path, so a copied tree is analysed instead of the
    # installed one
    return subprocess.run([str(LINT), "--no-cache"], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_the_tree_keeps_every_contract():
    proc = _lint(ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "3 kept, 0 broken" in proc.stdout


@pytest.mark.parametrize("module, forbidden, contract", [
    ("helpers/rank/metrics.py", "helpers.launch", "the rank side (helpers.rank) never imports the kernel side"),
    ("helpers/rank/data.py", "helpers.notebook.env", "the rank side (helpers.rank) never imports the kernel side"),
    ("helpers/calc/memory.py", "helpers.rank.devices", "pure calculations (helpers.calc) import neither side"),
    ("helpers/calc/dsconfig.py", "helpers.notebook.env", "pure calculations (helpers.calc) import neither side"),
    ("course/ddp_cifar10.py", "helpers.notebook.plots", "course/ scripts import only the rank side"),
    ("course/ds_cifar10.py", "helpers.launch", "course/ scripts import only the rank side"),
])
def test_a_forbidden_import_breaks_its_contract(tmp_path, module, forbidden, contract):
    for part in ("helpers", "course"):
        shutil.copytree(ROOT / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    with open(tmp_path / module, "a") as f:
        f.write(f"\nimport {forbidden}  # the forbidden import this test adds\n")
    proc = _lint(tmp_path)
    assert proc.returncode != 0, proc.stdout
    broken = proc.stdout.split("Broken contracts", 1)[-1]
    # contracts are transitive: a rank module importing the kernel side also breaks the course scripts' contract
    assert contract in broken and forbidden in broken, proc.stdout
