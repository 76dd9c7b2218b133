"""The layers of helpers/, enforced: import-linter's contracts in pyproject.toml hold for the tree as it is, and
each one breaks -- naming the offending import -- when a forbidden import is added to a copy of the tree; the pure
calculations import no torch and no DeepSpeed and touch no environment; the launcher names no course file."""
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).with_name("lint-imports")
LAYERS = "helpers in layers: notebook above launch above rank above calc"
COURSE = "course/ scripts import only the rank side"
CYCLES = "the notebook layer's runner above its Chinese build"


def _lint(cwd: Path) -> subprocess.CompletedProcess:
    # lint-imports puts its working directory first on sys.path, so a copied tree is analysed instead of the
    # installed one
    return subprocess.run([str(LINT), "--no-cache"], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_the_tree_keeps_every_contract():
    proc = _lint(ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "3 kept, 0 broken" in proc.stdout


@pytest.mark.parametrize("module, forbidden, contract", [
    ("helpers/launch/spec.py", "helpers.notebook.env", LAYERS),  # the launcher sits below the notebook helpers
    ("helpers/rank/metrics.py", "helpers.launch", LAYERS),
    ("helpers/rank/data.py", "helpers.notebook.env", LAYERS),
    ("helpers/calc/memory.py", "helpers.rank.devices", LAYERS),
    ("helpers/calc/dsconfig.py", "helpers.launch.spec", LAYERS),
    ("course/ddp_cifar10.py", "helpers.notebook.plots", COURSE),
    ("course/ds_cifar10.py", "helpers.launch", COURSE),
    ("helpers/notebook/i18n.py", "helpers.notebook.checks", CYCLES),  # the cycle the number templates once made
    ("helpers/notebook/translate.py", "helpers.notebook.runner", CYCLES),  # and the syllabus
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


# --------------------------------------------------------------------------------------------- what a layer may know

CALC = sorted((ROOT / "helpers" / "calc").glob("*.py"))


@pytest.mark.parametrize("path", CALC, ids=lambda p: p.name)
def test_pure_calculations_import_no_torch_or_deepspeed_and_write_no_environment(path):
    source = path.read_text()
    imports = re.findall(r"^\s*(?:import|from)\s+(torch|deepspeed)\b", source, re.M)
    assert not imports, f"{path.name} imports {imports}: facts from torch/DeepSpeed come in as arguments"
    assert "os.environ" not in source and "putenv" not in source, f"{path.name} touches the environment"


def test_importing_the_pure_calculations_loads_neither_torch_nor_deepspeed():
    modules = ", ".join(f"helpers.calc.{p.stem}" for p in CALC if p.stem != "__init__")
    code = f"import sys, {modules}; print(sorted({{'torch', 'deepspeed'}} & set(sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout


def test_production_code_does_not_use_unittest_mock():
    users = [str(p.relative_to(ROOT)) for p in (ROOT / "helpers").rglob("*.py")
             if re.search(r"unittest\.mock|from unittest import mock", p.read_text())]
    assert not users, users


def test_the_launcher_names_no_course_file():
    """helpers/launch knows no course script by name: a script's own launch rules are declared by the script
    (``LAUNCH_RULES``), so no file name of course/ appears anywhere under helpers/launch/, not even in a docstring."""
    names = [p.name for p in (ROOT / "course").iterdir()  # scripts, templates, configs ("hostfile" is a word)
             if p.is_file() and p.suffix and p.name != "__init__.py"]
    assert "fsdp2_cifar10.py" in names
    found = {str(p.relative_to(ROOT)): hits for p in sorted((ROOT / "helpers" / "launch").rglob("*.py"))
             if (hits := [n for n in names if n in p.read_text()])}
    assert not found, found
