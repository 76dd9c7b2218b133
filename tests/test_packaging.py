"""The set-up files agree with each other: conda users get what pip users get."""
import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def _pyproject_requirements():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return set(data["dependencies"]) | set(data["optional-dependencies"]["dev"])


def _conda_pip_section():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = [d for d in env["dependencies"] if isinstance(d, dict) and "pip" in d]
    assert len(pip) == 1, "environment.yml needs exactly one pip section"
    return env, pip[0]["pip"]


def test_environment_yml_lists_the_same_dependencies_as_pyproject():
    _, pip = _conda_pip_section()
    listed = {p for p in pip if not p.startswith("-")}
    assert listed == _pyproject_requirements()


def test_environment_yml_installs_the_project_like_the_makefile():
    env, pip = _conda_pip_section()
    makefile = (ROOT / "Makefile").read_text()
    install = re.search(r'pip install [^\n]*?-e "?(\.\[[a-z]+\])"?', makefile)
    assert install, "Makefile must install the project editable with extras"
    assert f"-e {install.group(1)}" in pip
    assert "python=3.11" in env["dependencies"]


def test_ci_calls_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "make test" in readme.split("\n## ")[0], "the test command belongs at the top of the README"
    assert "make test" in (ROOT / ".ci" / "run").read_text()
