"""The parts of one launch: a script that trains several configurations one after another, with one start-up for
all (its ranks' and torchrun's take longer than a few small steps), writes each into a folder of its own in the run
directory; the notebook reads each back as ``Run.part(name)`` (helpers.launch)."""
from __future__ import annotations

import os
from pathlib import Path

from .metrics import RUN_DIR_ENV


def run_dir() -> Path:
    """The run directory the launcher gave this rank ($HELPERS_RUN_DIR), else the working folder."""
    return Path(os.environ.get(RUN_DIR_ENV) or ".")


def enter(base: Path, name: str) -> Path:
    """Make ``base / name`` and point this rank's metrics, results and traces at it, until the next call."""
    folder = base / name
    folder.mkdir(parents=True, exist_ok=True)
    os.environ[RUN_DIR_ENV] = str(folder)
    return folder
