"""Fixtures shared by the test modules that launch real runs."""
from pathlib import Path

import psutil
import pytest


@pytest.fixture
def runs_root(tmp_path, monkeypatch) -> Path:
    """A fresh runs/ folder for this test: launches write there, not into the course's runs/."""
    root = tmp_path / "runs"
    monkeypatch.setenv("HELPERS_RUNS_DIR", str(root))
    return root


@pytest.fixture(scope="module")
def module_runs_root(tmp_path_factory) -> Path:
    """One runs/ folder for a whole module whose launches are shared between its tests."""
    root = tmp_path_factory.mktemp("runs")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HELPERS_RUNS_DIR", str(root))
        yield root


@pytest.fixture
def children_before() -> set[int]:
    """PIDs of this process's descendants before the test launches anything."""
    return {p.pid for p in psutil.Process().children(recursive=True)}
