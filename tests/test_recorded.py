"""tests/recorded.py: outcomes of real launches are replayed only for the inputs that produced them; any other input
fails "stale", naming what changed, and an outcome nobody recorded fails "not recorded"."""
import pytest

import recorded
from recorded import Recorder


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setattr(recorded, "STORE", tmp_path)
    return tmp_path


def test_a_recorded_outcome_is_replayed_for_the_same_inputs_without_launching(store, monkeypatch):
    inputs = {"task": "digest-of-the-script", "answer": "def f(): ...", "torch": "2.14.1"}
    monkeypatch.setenv(recorded.RECORD_ENV, "1")
    writer = Recorder("m")
    assert writer.get("t::one", "call #0", inputs, lambda: {"loss": [1.5, 0.25]}) == {"loss": [1.5, 0.25]}
    writer.save()
    monkeypatch.delenv(recorded.RECORD_ENV)
    reader = Recorder("m")
    assert reader.get("t::one", "call #0", inputs, lambda: pytest.fail("launched")) == {"loss": [1.5, 0.25]}


def test_a_changed_input_is_stale_and_says_which(store, monkeypatch):
    inputs = {"task": "a", "answer": "b", "torch": "2.14.1"}
    monkeypatch.setenv(recorded.RECORD_ENV, "1")
    writer = Recorder("m")
    writer.get("t::one", "call #0", inputs, lambda: 1)
    writer.save()
    monkeypatch.delenv(recorded.RECORD_ENV)
    reader = Recorder("m")
    for changed in ("task", "torch"):
        with pytest.raises(pytest.fail.Exception, match=f"stale: .*another {changed}; re-record with `make record`"):
            reader.get("t::one", "call #0", {**inputs, changed: "new"}, lambda: pytest.fail("launched"))
    with pytest.raises(pytest.fail.Exception, match="not recorded: t::two"):
        reader.get("t::two", "call #0", {**inputs, "answer": "other"}, lambda: pytest.fail("launched"))
    # an outcome is keyed by its inputs alone: another test asking for the same launch replays it
    assert reader.get("t::three", "call #0", inputs, lambda: pytest.fail("launched")) == 1


def test_re_recording_replaces_the_old_outcome_of_the_same_call(store, monkeypatch):
    monkeypatch.setenv(recorded.RECORD_ENV, "1")
    writer = Recorder("m")
    writer.get("t::one", "call #0", {"answer": "old"}, lambda: "old outcome")
    writer.get("t::one", "call #0", {"answer": "new"}, lambda: "new outcome")
    writer.save()
    assert [e["outcome"] for e in Recorder("m").entries.values()] == ["new outcome"]


def test_the_source_digest_follows_the_project_modules_a_script_imports(tmp_path, monkeypatch):
    """A task script's hash changes when a helpers module it imports (directly or through another) changes."""
    root = tmp_path
    (root / "helpers" / "rank").mkdir(parents=True)
    for init in ("helpers/__init__.py", "helpers/rank/__init__.py"):
        (root / init).write_text("")
    (root / "helpers" / "rank" / "a.py").write_text("from . import b\n")
    (root / "helpers" / "rank" / "b.py").write_text("X = 1\n")
    (root / "helpers" / "rank" / "unrelated.py").write_text("Y = 1\n")
    script = root / "task.py"
    script.write_text("import torch\nfrom helpers.rank import a\n")
    monkeypatch.setattr(recorded, "ROOT", root)
    before = recorded._source_digest(script)
    (root / "helpers" / "rank" / "unrelated.py").write_text("Y = 2\n")
    assert recorded._source_digest(script) == before
    (root / "helpers" / "rank" / "b.py").write_text("X = 2\n")
    assert recorded._source_digest(script) != before
