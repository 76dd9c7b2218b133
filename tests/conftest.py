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
    """PIDs of this process's descendants before the test launches anything (the warm launcher's server among them:
    it lives as long as this process, helpers/launch/warm.py)."""
    from helpers.launch import warm

    warm.warm_up(wait=True)
    return {p.pid for p in psutil.Process().children(recursive=True)}


# --- recorded outcomes of real launches (tests/recorded.py; `make record` records them) ----------------------------

from recorded import Recorder, recording  # noqa: E402


@pytest.fixture(scope="session")
def _recorders():
    stores: dict[str, Recorder] = {}
    yield stores
    for store in stores.values():
        store.save()


@pytest.fixture
def recorder(request, _recorders) -> Recorder:
    """This test module's store of recorded outcomes (tests/recorded/<module>.json)."""
    name = request.module.__name__.rpartition(".")[2]
    return _recorders.setdefault(name, Recorder(name))


def pytest_collection_modifyitems(config, items):
    """Under `make record`, run only the tests that replay recorded outcomes (and not the ones that launch anyway)."""
    if not recording():
        return
    keep = [i for i in items if "recorder" in i.fixturenames and i.get_closest_marker("slow") is None]
    config.hook.pytest_deselected(items=[i for i in items if i not in keep])
    items[:] = keep


@pytest.fixture
def exercise_ranks(request, recorder, monkeypatch):
    """The write-the-code checkers' launches: real for a test marked slow, otherwise replayed from the store."""
    from recorded import replay_exercise_ranks
    replay_exercise_ranks(request, recorder, monkeypatch)


@pytest.fixture
def refused_in_rank(monkeypatch):
    """``refused_in_rank("course/x.py", [args], world_size=2)``: run the script's ``main()`` in this process as rank 0
    of ``world_size`` (as torchrun would start it from a terminal, without helpers.launch) and return the message it
    stops with; the test fails if the script reaches ``init_process_group`` first (a refusal must come before any
    rank waits for the others)."""
    import importlib.util
    import sys
    import warnings

    import torch.distributed as dist

    def refuse(script: str, args: list, world_size: int = 2) -> str:
        path = Path(__file__).resolve().parents[1] / script
        spec = importlib.util.spec_from_file_location(f"refusal_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE":
                            str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1",
                            "CUDA_VISIBLE_DEVICES": ""}.items():
            monkeypatch.setenv(name, value)
        monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
        monkeypatch.setattr(sys, "argv", [str(path), *map(str, args)])
        monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: pytest.fail("reached init_process_group"))
        with pytest.raises(SystemExit) as stopped, warnings.catch_warnings():
            # torchrun's @record turns on faulthandler, which needs a real stderr; pytest's capture has none
            warnings.filterwarnings("ignore", "Unable to enable fault handler")
            module.main()
        assert stopped.value.code not in (0, None), "the script exited as if it had succeeded"
        return str(stopped.value.code)
    return refuse
