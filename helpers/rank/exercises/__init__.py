"""Inside a rank: run a learner's distributed code on real ranks and write down what it did.

The kernel-side checkers (:mod:`helpers.notebook.exercises.write`) save the learner's function into a file and launch
one of the task scripts beside this module on 2-3 gloo ranks. A task script imports the function with
:func:`load_answer`, runs it with the process group up, and records what each rank saw with :func:`save_outcome`
(``exercise-rank<k>.json`` in the run directory); the checker compares those records with the reference.

A learner's exception is recorded (type, message, the line of their code, the module that raised it) before the rank
exits non-zero, so the checker can quote it instead of a launcher traceback. A rank that waits forever is caught by
the launcher's stall timeout; the checker turns that into the hint for the mistake that causes it.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import traceback
from pathlib import Path

from ..metrics import RUN_DIR_ENV
from ..runtime import end_rank

OUTCOME = "exercise-rank{rank}.json"
ANSWER_MODULE = "answer"


def load_answer(path: str | os.PathLike, name: str):
    """The function ``name`` defined in the learner's saved file ``path``."""
    spec = importlib.util.spec_from_file_location(ANSWER_MODULE, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[ANSWER_MODULE] = module
    spec.loader.exec_module(module)
    return getattr(module, name)


def save_outcome(rank: int, **fields) -> None:
    """Write this rank's record for the checker (atomically: a half-written record is never read)."""
    run_dir = Path(os.environ.get(RUN_DIR_ENV, "."))
    path = run_dir / OUTCOME.format(rank=rank)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(fields))
    os.replace(tmp, path)


def _answer_line(tb) -> int | None:
    """The line of the learner's file where the exception went through last (None: not in their code)."""
    line = None
    for frame, lineno in traceback.walk_tb(tb):
        if frame.f_globals.get("__name__") == ANSWER_MODULE:
            line = lineno
    return line


def _raised_in(tb) -> str:
    """The module whose code raised: that of the traceback's innermost Python frame (``answer``: the learner's)."""
    module = "?"
    for frame, _lineno in traceback.walk_tb(tb):
        module = frame.f_globals.get("__name__", "?")
    return module


def one_rank_fewer(rank: int, world: int, store) -> bool:
    """Replace the process group by a new one of ranks 0 .. world-2 on the same ``store`` (the last rank leaves), so
    that a task can run the learner's function again at another rank count in the same launch: an answer written
    for one rank count is then wrong at the other. True on the ranks of the new group."""
    import torch.distributed as dist

    dist.destroy_process_group()
    if rank >= world - 1:
        return False
    os.environ["WORLD_SIZE"] = str(world - 1)  # for an answer that reads it rather than dist.get_world_size()
    dist.init_process_group("gloo", store=dist.PrefixStore(f"ranks-{world - 1}", store), rank=rank,
                            world_size=world - 1)
    return True


def _world_size() -> int | None:
    """The size of the process group up now (after :func:`one_rank_fewer`, one less than launched)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else None


def run_task(rank: int, task) -> None:
    """Run ``task()`` (returns this rank's outcome fields) and record it; a learner's exception is recorded and the
    rank exits with status 1, so the launcher stops the other ranks instead of leaving them waiting."""
    print(f"rank {rank} ready", flush=True)  # a sign of life: the launcher's stall clock starts here
    try:
        fields = task()
    except Exception as e:  # noqa: BLE001 - the learner's mistake becomes a verdict, not a traceback
        save_outcome(rank, error={"type": type(e).__name__, "message": str(e)[:500],
                                  "line": _answer_line(e.__traceback__), "where": _raised_in(e.__traceback__),
                                  "world_size": _world_size()})
        end_rank(1)
    save_outcome(rank, **fields)
