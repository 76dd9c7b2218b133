"""Running a learner's function on real ranks, for the write-the-code exercises (:mod:`.write`).

:func:`run_on_ranks` saves the learner's source (after the imports the exercise cell gives, :data:`PREAMBLE`) into a
file and launches a task script of :mod:`helpers.rank.exercises` on gloo ranks with :func:`helpers.launch.torchrun`;
:func:`launch_problem` turns a run that did not finish into a verdict (the learner's exception quoted with its line,
or the hint for a hang); :func:`parity_bound` is the tolerance for "the same computation as one process", built on
a rounding floor measured in the same run.
"""
from __future__ import annotations

import ast
import inspect
import json
import tempfile
import textwrap
from pathlib import Path

from ... import launch
from ...calc import parity
from ...rank.exercises import OUTCOME
from ..i18n import _
from . import Verdict

STALL_S = 30  # seconds without a sign of life before a run counts as hung
TASKS = Path(__file__).resolve().parents[2] / "rank" / "exercises"

# what the exercise cells import for the learner; their saved function sees the same names
PREAMBLE = {
    "ring_all_reduce": "import torch\nimport torch.distributed as dist\n",
    "shard": ("import torch\nfrom torch.distributed.fsdp import fully_shard\n"),
    "save_checkpoint": "import os\n\nimport torch\nimport torch.distributed as dist\n",
    "train_step": "import contextlib\n\nimport torch\nfrom torch import nn\n",
    "train": ("import torch\nimport torch.distributed as dist\nfrom torch import nn\n"
              "from torch.nn.parallel import DistributedDataParallel as DDP\n"
              "from torch.utils.data import DataLoader, DistributedSampler\n"),
}


def function_source(answer, name: str) -> str:
    """The source of the learner's function ``name``: the function itself, or a string of code defining it. A
    function is preceded by imports of the modules and names it uses from its cell's namespace (``F`` for
    ``torch.nn.functional``, say), so the saved file sees what the cell saw."""
    source = textwrap.dedent(inspect.getsource(answer) if callable(answer) else answer)
    tree = ast.parse(source)
    if not any(isinstance(n, ast.FunctionDef) and n.name == name for n in tree.body):
        raise ValueError(f"no function named {name} in that code")
    return (_imports_used_by(answer) + source) if callable(answer) else source


def _global_names(code) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):  # nested functions, comprehensions, lambdas
            names |= _global_names(const)
    return names


def _imports_used_by(fn) -> str:
    """Import lines for the globals ``fn`` refers to that are modules, or classes and functions of a module."""
    lines = []
    for name in sorted(_global_names(fn.__code__)):
        value = fn.__globals__.get(name)
        if inspect.ismodule(value):
            lines.append(f"import {value.__name__} as {name}")
        elif (inspect.isclass(value) or inspect.isfunction(value) or inspect.isbuiltin(value)) \
                and getattr(value, "__module__", None) not in (None, "__main__", "builtins") \
                and "." not in value.__qualname__ and "<" not in value.__qualname__:
            lines.append(f"from {value.__module__} import {value.__qualname__} as {name}")
    return "\n".join(lines) + "\n\n" if lines else ""


def is_stub(source: str, name: str) -> bool:
    """True while the function's body is still only a docstring, ``...``, ``pass`` or ``raise NotImplementedError``."""
    fn = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == name)
    for stmt in fn.body:
        if isinstance(stmt, ast.Pass):
            continue
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) \
                and (stmt.value.value is Ellipsis or isinstance(stmt.value.value, str)):
            continue
        if isinstance(stmt, ast.Raise) and stmt.exc is not None and "NotImplementedError" in ast.unparse(stmt.exc):
            continue
        return False
    return True


def stub_verdict() -> Verdict:
    return Verdict(False, _("the function is still the exercise's outline, so nothing was launched."),
                   _("Replace the ... with your lines, run the cell again, then run this check."))


def _prefix(name: str) -> str:
    return PREAMBLE[name] + "\n\n"


# the tasks are gloo programs on CPU tensors: hide any GPUs, so a 1-GPU machine runs the 2-3 ranks too (the launcher
# refuses more CUDA ranks than GPUs), and give each rank one thread
TASK_ENV = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


def run_on_ranks(task: str, source: str, name: str, nproc: int, args=(), timeout: float = 120,
                 ) -> tuple[dict[int, dict], launch.LaunchError | None]:
    """Launch ``helpers/rank/exercises/<task>.py`` on ``nproc`` ranks with the learner's ``source`` (and ``args``
    for the task); return each rank's recorded outcome and the launch's error (None if every rank finished)."""
    answers = launch.runs_root() / "exercise-answers"
    answers.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".py", prefix=f"{name}-", dir=answers, delete=False) as f:
        f.write(_prefix(name) + source)
    error, run_dir = None, None
    try:
        run_dir = launch.torchrun(TASKS / f"{task}.py", nproc=nproc, args=["--answer", f.name, *args], show="none",
                                  timeout=timeout, stall_timeout=STALL_S, name=f"exercise-{task}",
                                  env=TASK_ENV).run_dir
    except launch.LaunchError as e:
        error, run_dir = e, e.run_dir
    outcomes = {}
    for rank in range(nproc):
        path = Path(run_dir or ".") / OUTCOME.format(rank=rank)
        if run_dir and path.exists():
            outcomes[rank] = json.loads(path.read_text())
    return outcomes, error


def launch_problem(outcomes: dict[int, dict], error, hang_hint: str, name: str, source: str) -> Verdict | None:
    """The verdict for a run that did not finish: the learner's exception quoted, or the hint for a hang."""
    failed = sorted((_knock_on(o["error"]), rank, o["error"]) for rank, o in outcomes.items() if "error" in o)
    if failed:
        _later, rank, e = failed[0]  # the rank whose own lines failed, before those that lost it as a peer
        if e.get("line"):
            saved = (_prefix(name) + source).splitlines()  # the file the rank ran: imports, then the function
            first = next(i for i, text in enumerate(saved) if text.startswith(f"def {name}("))
            line = e["line"] - first
            said = _("rank {rank} stopped with {error_type} at line {line} of your function: {error}",
                     rank=rank, error_type=e["type"], line=line, error=e["message"])
        else:
            said = _("rank {rank} stopped with {error_type}: {error}", rank=rank, error_type=e["type"],
                     error=e["message"])
        return Verdict(False, said, _error_hint(e))
    if error is None:
        return None
    if error.reason in ("stalled", "timeout"):
        return Verdict(False, _("the ranks stopped making progress and were stopped: some rank waits for a "
                                "message or a collective that never comes."), hang_hint)
    return Verdict(False, _("the run failed before your code finished: {error}", error=str(error).splitlines()[0]),
                   _("Run the cell with your function again; if it keeps failing, read the error above."))


def _knock_on(error: dict) -> bool:
    """True for an error a rank got only because another rank had already failed (its connection went away)."""
    return error["type"] == "RuntimeError" and "by peer" in error["message"]


_ERROR_HINTS = (
    ("by peer", _("Another rank had already left: it finished without calling this collective. Every rank must "
                  "call the same collectives in the same order, whatever its rank.")),
    ("mutually exclusive with shuffle", _("A DistributedSampler does the shuffling: give the DataLoader "
                                          "sampler=... and leave out shuffle=True.")),
    ("list index out of range", _("torch.chunk can return fewer than N pieces when the tensor is short; "
                                  "torch.tensor_split(tensor, N) always returns N (some may be empty).")),
    ("PytorchStreamReader", _("The checkpoint on disk is cut off: the job died while writing it, and it was written "
                              "in place. Save to a temporary file in the same folder, then os.replace() it onto the "
                              "checkpoint's name: the name then always points at a whole file.")),
    ("Default process group has not been initialized", _("The process group is already set up when your "
                                                         "function runs; do not destroy it inside.")),
)


def _error_hint(error: dict) -> str:
    for needle, hint in _ERROR_HINTS:
        if needle in error["message"]:
            return hint
    return _("Read the error: it is raised by your lines, on that rank.")


PARITY_K = parity.K  # how many rounding floors another ordering of the same sums may drift (helpers.calc.parity)


def parity_bound(reference_fp32: list[float], reference_fp64: list[float]) -> tuple[float, float]:
    """(floor, tolerance) for "the same computation as one process": the floor is how far one process's float32
    numbers are from its float64 ones (:func:`helpers.calc.parity.floor`), measured in the same run; float addition
    is not associative, so another order of the same sums lands within a few floors, :data:`PARITY_K` of them."""
    floor = parity.floor(reference_fp32, reference_fp64)
    return floor, PARITY_K * floor


def close(a: list[float], b: list[float], tolerance: float) -> bool:
    return max(abs(x - y) for x, y in zip(a, b)) <= tolerance
