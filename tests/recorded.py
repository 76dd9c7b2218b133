"""Outcomes of real launches, recorded once and replayed by fast tests (DESIGN.md, "How the course is proven").

A wrong answer to a write-the-code exercise, or one cell of the pipeline-schedule matrix, needs real ranks to find out
what it does; what the checker or the test then decides from that outcome is plain Python. So the outcome is
recorded from a real launch by ``make record`` and stored in ``tests/recorded/<test module>.json`` under a key that is
a hash of everything that produced it:

- the launched script and every ``helpers`` module it imports (followed through the imports),
- what the test gave it (the answer's source, the rank count, the arguments),
- torch's version.

A fast test asks for its outcome by those inputs. If any of them changed, the key is not in the store, and the test
fails with "stale: ... re-record with `make record`", naming which input changed. Nothing here is written by hand:
an entry exists only because :meth:`Recorder.get` ran ``produce`` (a real launch) in record mode.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable

import pytest

ROOT = Path(__file__).resolve().parents[1]
STORE = Path(__file__).resolve().parent / "recorded"
RECORD_ENV = "RECORD_RUNS"  # `make record` sets it: launch for real and store what came out


def recording() -> bool:
    return os.environ.get(RECORD_ENV) == "1"


def _digest(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()[:16]


def _module_file(name: str) -> Path | None:
    parts = name.split(".")
    for candidate in (ROOT.joinpath(*parts).with_suffix(".py"), ROOT.joinpath(*parts, "__init__.py")):
        if candidate.exists():
            return candidate
    return None


def _imported(path: Path) -> set[str]:
    """The ``helpers``/``course`` modules ``path`` imports (absolute or relative), and the packages above them."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names.add(base)
            names |= {f"{base}.{a.name}" for a in node.names}  # `from pkg import module`
    found = set()
    for name in names:
        if name.split(".")[0] not in ("helpers", "course"):
            continue
        parts = name.split(".")
        for i in range(1, len(parts) + 1):  # importing a.b.c runs a/__init__ and a/b/__init__ too
            if _module_file(".".join(parts[:i])) is not None:
                found.add(".".join(parts[:i]))
    return found


@functools.lru_cache(maxsize=None)
def _cached_digest(script: Path, stamp: tuple) -> str:
    return _source_digest(script)


def source_digest(script: Path) -> str:
    """A hash of ``script`` and of every project module it imports, followed through their imports (cached while
    none of the project's files changed)."""
    files = sorted(ROOT.glob("helpers/**/*.py")) + sorted(ROOT.glob("course/*.py")) + [Path(script)]
    stamp = tuple((str(p), p.stat().st_mtime_ns) for p in files)
    return _cached_digest(Path(script).resolve(), stamp)


def _source_digest(script: Path) -> str:
    """A hash of ``script`` and of every project module it imports, followed through their imports."""
    files: set[Path] = set()
    todo = [Path(script).resolve()]
    while todo:
        path = todo.pop()
        if path not in files:
            files.add(path)
            todo += [_module_file(name) for name in _imported(path)]
    return _digest("".join(f"{p.relative_to(ROOT)}\n{p.read_text()}" for p in sorted(files)))


@functools.lru_cache(maxsize=None)
def torch_version() -> str:
    import torch
    return torch.__version__


class Recorder:
    """One test module's store of recorded outcomes."""

    def __init__(self, module: str):
        self.path = STORE / f"{module}.json"
        self.entries: dict[str, dict] = json.loads(self.path.read_text()) if self.path.exists() else {}
        self.dirty = False

    def get(self, test: str, label: str, inputs: dict[str, str], produce: Callable[[], Any]) -> Any:
        """The outcome for ``inputs`` (name -> text or digest): replayed from the store, or, under ``make
        record``, produced by ``produce()`` (a real launch) and stored."""
        digests = {name: _digest(value) for name, value in sorted(inputs.items())}
        key = _digest(json.dumps(digests, sort_keys=True))
        if recording():
            result = produce()
            for k in [k for k, e in self.entries.items() if (e["test"], e["label"]) == (test, label)]:
                del self.entries[k]
            self.entries[key] = {"test": test, "label": label, "inputs": digests, "outcome": result}
            self.dirty = True
            return result
        if key in self.entries:
            return self.entries[key]["outcome"]
        old = next((e for e in self.entries.values() if (e["test"], e["label"]) == (test, label)), None)
        if old is None:
            pytest.fail(f"not recorded: {test} [{label}]; record it with `make record`", pytrace=False)
        changed = sorted(n for n in digests if old["inputs"].get(n) != digests[n])
        pytest.fail(f"stale: {test} [{label}] was recorded with another {', '.join(changed)}; "
                    f"re-record with `make record`", pytrace=False)

    def save(self) -> None:
        if self.dirty:
            STORE.mkdir(exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            # one entry per line: a re-record's diff shows which outcomes changed
            lines = [f"{json.dumps(k)}: {json.dumps(e, sort_keys=True)}" for k, e in sorted(self.entries.items())]
            tmp.write_text("{\n" + ",\n".join(lines) + "\n}\n")
            os.replace(tmp, self.path)
            self.dirty = False


def mistakes(catalogue, launched: str) -> list:
    """A checker's catalogue of wrong answers as test parameters: ``launched`` runs on real ranks (the slow tier
    proves that the checker still launches and judges one), the others replay their recorded outcomes (fast)."""
    assert launched in catalogue, launched
    return [pytest.param(m, marks=pytest.mark.slow) if m == launched else m for m in catalogue]


def replay_exercise_ranks(request, recorder: Recorder, monkeypatch) -> None:
    """Make the write-the-code checkers read each launch's per-rank outcomes (and the names of the files it left in
    a folder it was given) from ``recorder`` instead of launching, unless the test is marked slow (a real launch)."""
    import itertools
    import sys

    from helpers import launch
    from helpers.notebook.exercises import ranks

    if request.node.get_closest_marker("slow") is not None:
        return
    real = ranks.run_on_ranks
    calls = itertools.count()

    def replayed(task, source, name, nproc, args=(), timeout=120):
        folders = [a for a in args if Path(a).is_dir()]
        inputs = {"task": source_digest(ranks.TASKS / f"{task}.py"), "answer": ranks.PREAMBLE.get(name, "") + source,
                  "nproc": str(nproc), "args": json.dumps(["<folder>" if a in folders else a for a in args]),
                  "torch": torch_version()}

        def produce():
            outcomes, error = real(task, source, name, nproc, args, timeout)
            return {"outcomes": [[r, o] for r, o in sorted(outcomes.items())],
                    "error": None if error is None else {"message": str(error), "reason": error.reason,
                                                         "rank": error.rank, "exitcode": error.exitcode},
                    "files": [sorted(p.name for p in Path(f).iterdir()) for f in folders]}

        got = recorder.get(request.node.nodeid, f"{task} #{next(calls)}", inputs, produce)
        if not recording():
            for folder, names in zip(folders, got["files"]):
                for file in names:
                    (Path(folder) / file).touch()
        e = got["error"]
        error = None if e is None else launch.LaunchError(e["message"], rank=e["rank"], exitcode=e["exitcode"],
                                                          reason=e["reason"])
        return {int(r): o for r, o in got["outcomes"]}, error

    for module in list(sys.modules.values()):
        if module is not None and module.__name__.startswith("helpers.notebook.exercises") \
                and getattr(module, "run_on_ranks", None) is real:
            monkeypatch.setattr(module, "run_on_ranks", replayed)
