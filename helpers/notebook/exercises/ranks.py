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
import linecache
import tempfile
import textwrap
from pathlib import Path

from ... import launch
from ...calc import parity
from ...rank.exercises import ANSWER_MODULE, OUTCOME
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
    ``torch.nn.functional``, say), and by the helpers it calls that the learner defined beside it (functions,
    classes and plain constants of the notebook, followed through the helpers' own names), so the saved file sees
    what the cell saw."""
    source = textwrap.dedent(inspect.getsource(answer) if callable(answer) else answer)
    tree = ast.parse(source)
    if not any(isinstance(n, ast.FunctionDef) and n.name == name for n in tree.body):
        raise ValueError(f"no function named {name} in that code")
    if not callable(answer):
        return source
    helpers = _helpers_used_by(answer)
    imports = "".join(_imports_used_by(fn) for fn in [answer, *helpers.values()] if inspect.isfunction(fn))
    imports = "".join(dict.fromkeys(imports.splitlines(keepends=True)))  # each import once
    return (imports + "\n" if imports else "") + "".join(f"{code}\n\n\n" for code in _helper_sources(helpers)) \
        + source


def _global_names(code) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):  # nested functions, comprehensions, lambdas
            names |= _global_names(const)
    return names


def _imports_used_by(fn) -> str:
    """Import lines for the globals ``fn`` refers to that are modules, or classes and functions of a module other
    than ``fn``'s own (those are shipped as source, :func:`_helpers_used_by`)."""
    lines = []
    for name in sorted(_global_names(fn.__code__)):
        value = fn.__globals__.get(name)
        if inspect.ismodule(value):
            lines.append(f"import {value.__name__} as {name}")
        elif (inspect.isclass(value) or inspect.isfunction(value) or inspect.isbuiltin(value)) \
                and getattr(value, "__module__", None) not in (None, "__main__", "builtins", fn.__module__) \
                and "." not in value.__qualname__ and "<" not in value.__qualname__:
            lines.append(f"from {value.__module__} import {value.__qualname__} as {name}")
    return "\n".join(lines) + "\n" if lines else ""


def _names_used_by(value) -> set[str]:
    """The global names a function's code, or a class's bases and methods, refer to."""
    if inspect.isfunction(value):
        return _global_names(value.__code__)
    names = {base.__name__ for base in value.__bases__}
    for member in vars(value).values():
        fn = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
        if inspect.isfunction(fn):
            names |= _global_names(fn.__code__)
    return names


def _is_literal(value) -> bool:
    """A plain constant whose repr reads back as itself: a number, a string, or a tuple/list/dict/set of them."""
    if not isinstance(value, (int, float, str, bytes, tuple, list, dict, set, frozenset)) and value is not None:
        return False
    try:
        return ast.literal_eval(repr(value)) == value
    except (ValueError, SyntaxError, RecursionError):
        return False


def _helpers_used_by(fn) -> dict[str, object]:
    """The functions, classes and plain constants of ``fn``'s own module (the notebook's ``__main__``) that it refers
    to, and those they refer to in turn, by name."""
    found, todo = {}, [fn]
    while todo:
        for name in sorted(_names_used_by(todo.pop())):
            value = fn.__globals__.get(name)
            if name in found or value is None or value is fn or inspect.ismodule(value):
                continue
            if (inspect.isfunction(value) and value.__globals__ is fn.__globals__) or \
                    (inspect.isclass(value) and value.__module__ == fn.__module__):
                found[name] = value
                todo.append(value)
            elif _is_literal(value):
                found[name] = value
    return found


def _source_line(value) -> int:
    try:
        return inspect.getsourcelines(value)[1]
    except (OSError, TypeError):
        return 0


def _helper_sources(helpers: dict[str, object]) -> list[str]:
    """Each helper as code: the constants as ``NAME = repr``, then the classes and the functions in the order they
    were defined (a base class before the class built on it)."""
    consts = [f"{name} = {value!r}" for name, value in helpers.items()
              if not (inspect.isfunction(value) or inspect.isclass(value))]
    codes = ["\n".join(consts)] if consts else []
    defined = sorted(((name, v) for name, v in helpers.items() if inspect.isfunction(v) or inspect.isclass(v)),
                     key=lambda item: (not inspect.isclass(item[1]), _source_line(item[1])))
    for name, value in defined:
        if value.__name__ != name:  # known here by another name (an alias): its source would define the wrong one
            codes.append(f"{name} = {value.__name__}")
            continue
        code = _definition_source(value)
        if code is not None:  # else no source was kept for it: the rank will name the missing name
            codes.append(code)
    return codes


def _definition_source(value) -> str | None:
    """The source of a function or class. A class of a notebook has no file that inspect can find (Python 3.11),
    so it is read from the cell its methods were compiled from (IPython keeps each cell's text in linecache)."""
    try:
        return textwrap.dedent(inspect.getsource(value)).rstrip("\n")
    except (OSError, TypeError):
        if not inspect.isclass(value):
            return None
    for member in vars(value).values():
        fn = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
        if not inspect.isfunction(fn):
            continue
        text = "".join(linecache.getlines(fn.__code__.co_filename))
        try:
            tree = ast.parse(text)
        except SyntaxError:
            return None
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name == value.__name__ \
                    and node.lineno <= fn.__code__.co_firstlineno <= node.end_lineno:
                return textwrap.dedent(ast.get_source_segment(text, node, padded=True))
    return None


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


def launch_problem(outcomes: dict[int, dict], error, hang_hint: str, name: str, source: str,
                   right_run=None) -> Verdict | None:
    """The verdict for a run that did not finish: the learner's exception quoted, or the hint for a hang.
    ``right_run(run)``, where a task reruns on one rank fewer, tells whether a rank's first run was right: a hang
    after the rank that sat the rerun out had a right one is a rank-count slip."""
    failed = sorted((_knock_on(o["error"]), rank, o["error"]) for rank, o in outcomes.items() if "error" in o)
    if failed:
        _later, rank, e = failed[0]  # the rank whose own lines failed, before those that lost it as a peer
        where = e.get("where", ANSWER_MODULE)  # the module whose code raised (recorded by the rank)
        if not e.get("line"):
            said = _("rank {rank} stopped with {error_type}, raised outside your function (in {where}): {error}",
                     rank=rank, error_type=e["type"], error=e["message"],
                     where=_("the checking task") if where == "__main__" else where)
            return Verdict(False, said, _error_hint(e, _("It was raised by the checking task or by torch, after your "
                                                         "function returned or before it ran: check what your "
                                                         "function returns (its type and shape) and that it leaves "
                                                         "the process group as it found it.")))
        launched = max(outcomes) + 1
        if e.get("world_size") and e["world_size"] < launched:  # in the rerun on fewer ranks (one_rank_fewer)
            fewer = _("It ran through on {launched} ranks and failed on {world}: your code works for one rank count "
                      "only. Take the rank count from dist.get_world_size() and the rank from dist.get_rank(), never "
                      "a fixed number.", launched=launched, world=e["world_size"])
        else:
            fewer = None
        function, line = _answer_position(_prefix(name) + source, e["line"], name)
        if function == name:
            said = _("rank {rank} stopped with {error_type} at line {line} of your function: {error}",
                     rank=rank, error_type=e["type"], line=line, error=e["message"])
        else:
            said = _("rank {rank} stopped with {error_type} at line {line} of {function}, from your cell: {error}",
                     rank=rank, error_type=e["type"], line=line, function=function, error=e["message"])
        if fewer is not None:
            return Verdict(False, said, fewer)
        if where == ANSWER_MODULE:
            return Verdict(False, said, _error_hint(e, _("Read the error: it is raised by your lines, on that rank.")))
        return Verdict(False, said, _error_hint(e, _("The error is raised inside {where}, called from that line: "
                                                     "check the arguments your line passes it (their types, shapes "
                                                     "and ranks).", where=where)))
    if error is None:
        return None
    if error.reason in ("stalled", "timeout"):
        said = _("the ranks stopped making progress and were stopped: some rank waits for a message or a collective "
                 "that never comes.")
        left = [o for o in outcomes.values() if right_run is not None and len(o.get("runs", ())) == 1
                and o["world_size"] > 2 and right_run(o["runs"][0])]
        if left:  # the last rank sat the rerun out (one_rank_fewer) after a run at the full count: the rerun hung
            return Verdict(False, said, _("It ran through on {launched} ranks and hung on {world}: your code works "
                                          "for one rank count only. Take the rank count from dist.get_world_size() "
                                          "and the rank from dist.get_rank(), never a fixed number.",
                                          launched=left[0]["world_size"], world=left[0]["world_size"] - 1))
        return Verdict(False, said, hang_hint)
    return Verdict(False, _("the run failed before your code finished: {error}", error=str(error).splitlines()[0]),
                   _("Run the cell with your function again; if it keeps failing, read the error above."))


def by_world(outcomes: dict[int, dict]) -> dict[int, dict[int, dict]]:
    """A task's runs at several rank counts in one launch (each rank's ``runs``), as {world size: {rank: run}}."""
    runs: dict[int, dict[int, dict]] = {}
    for rank, o in outcomes.items():
        for run in o["runs"]:
            runs.setdefault(run["world_size"], {})[rank] = run
    return runs


def one_count_hint(right: int, world: int) -> str:
    """The hint for an answer that is right at one rank count and wrong at another."""
    return _("Right on {right} ranks, wrong on {world}: your code works for one rank count only. Take the rank "
             "count from dist.get_world_size() and the rank from dist.get_rank(), never a fixed number.",
             right=right, world=world)


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
    ("tuple index out of range", _("A rank asked for a piece that is not there: split into dist.get_world_size() "
                                   "pieces and take piece dist.get_rank(), whatever the rank count.")),
    ("PytorchStreamReader", _("The checkpoint on disk is cut off: the job died while writing it, and it was written "
                              "in place. Save to a temporary file in the same folder, then os.replace() it onto the "
                              "checkpoint's name: the name then always points at a whole file.")),
    ("Default process group has not been initialized", _("The process group is already set up when your "
                                                         "function runs; do not destroy it inside.")),
)


def _error_hint(error: dict, otherwise: str) -> str:
    for needle, hint in _ERROR_HINTS:
        if needle in error["message"]:
            return hint
    return otherwise


def _answer_position(saved: str, lineno: int, name: str) -> tuple[str, int]:
    """(the function or class of the saved file that holds line ``lineno``, the line within it, from 1)."""
    tree = ast.parse(saved)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
                and node.lineno <= lineno <= node.end_lineno:
            return node.name, lineno - node.lineno + 1  # the def line is line 1
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    return name, lineno - fn.lineno + 1


PARITY_K = parity.K  # how many rounding floors another ordering of the same sums may drift (helpers.calc.parity)


def parity_bound(reference_fp32: list[float], reference_fp64: list[float]) -> tuple[float, float]:
    """(floor, tolerance) for "the same computation as one process": the floor is how far one process's float32
    numbers are from its float64 ones (:func:`helpers.calc.parity.floor`), measured in the same run; float addition
    is not associative, so another order of the same sums lands within a few floors, :data:`PARITY_K` of them."""
    floor = parity.floor(reference_fp32, reference_fp64)
    return floor, PARITY_K * floor


def close(a: list[float], b: list[float], tolerance: float) -> bool:
    return max(abs(x - y) for x, y in zip(a, b)) <= tolerance
