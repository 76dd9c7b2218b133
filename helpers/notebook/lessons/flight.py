"""Notebook 06 (fault tolerance and debugging), debugging section: torch's Flight Recorder on gloo, read two ways.

``course/pitfall_desync.py`` makes the ranks disagree about a collective (``order``: the last rank swaps broadcast
and all_reduce; ``missing``: the last rank skips the last step's all_reduce), fails after its ``--timeout-s``, and
leaves every rank's Flight Recorder buffer in ``<run dir>/fr/fr_rank<R>`` (a pickle). This module reads those dumps
twice: with torch's own analyser (:func:`analyse`, ``python -m torch.distributed.flight_recorder.fr_trace``) and with
a small parser of its own (:func:`stuck`), and claims both name the rank and collective the script got wrong on
purpose.

Example (notebook cells)::

    from helpers.notebook.lessons import flight as lesson
    order = lesson.run_scenario("order", nproc=2)     # a LaunchError: the run fails on purpose
    lesson.show_analysis(order)
    lesson.claim_desync(order, "order")
    # [check] the Flight Recorder dumps name the rank that stopped and the collective it waited in: True
    #    (measured: rank 1, broadcast #5, where the others called all_reduce)
"""
from __future__ import annotations

import json
import pickle
import subprocess
import sys
from collections import Counter
from pathlib import Path

from ..checks import claim
from .faults import tidy

SCRIPT = "course/pitfall_desync.py"
DUMPS = "fr"  # the dumps' folder in the run directory, and their file name before the rank (the script's)
PREFIX = "fr_rank"
STEPS = 4  # the script's --steps default: ordinary all_reduces before the fault
ANALYSER = "torch.distributed.flight_recorder.fr_trace"


def run_scenario(scenario: str, nproc: int = 2, timeout_s: float = 5.0, **kwargs):
    """Launch the script with ``--scenario``; the :class:`~helpers.launch.Run`, or the ``LaunchError`` a failing run
    raises (``order`` and ``missing`` fail on purpose: both carry ``run_dir``)."""
    from ... import launch

    kwargs.setdefault("show", "none")
    try:
        return launch.torchrun(SCRIPT, nproc=nproc, args=["--scenario", scenario, "--timeout-s", str(timeout_s)],
                               env={"CUDA_VISIBLE_DEVICES": ""}, timeout=60 + 6 * timeout_s,
                               name=f"06_desync_{scenario}", **kwargs)
    except launch.LaunchError as error:
        return error


def _run_dir(run) -> Path:
    """A Run's or a LaunchError's run directory (or a path given as such)."""
    return Path(getattr(run, "run_dir", None) or run)


def dumps(run) -> dict[int, dict]:
    """{rank: that rank's unpickled Flight Recorder dump} of a run (its ``fr/fr_rank<R>`` files)."""
    found = {}
    for path in sorted((_run_dir(run) / DUMPS).glob(f"{PREFIX}*")):
        if path.name[len(PREFIX):].isdigit():
            found[int(path.name[len(PREFIX):])] = pickle.loads(path.read_bytes())
    return dict(sorted(found.items()))


def collectives(dump: dict) -> dict[int, str]:
    """{sequence number: collective} of one dump's collectives ("gloo:all_reduce" -> "all_reduce"; p2p left out)."""
    return {e["collective_seq_id"]: e["profiling_name"].split(":")[-1]
            for e in dump.get("entries", []) if not e.get("is_p2p")}


def first_disagreement(calls: dict[int, dict[int, str]]) -> dict | None:
    """The first sequence number at which the ranks' records differ, from {rank: {seq: collective}}: ``seq``, the
    ``expected`` collective (what most ranks called there; a tie goes to the lowest rank, as torch's analyser
    does), the first ``rank`` that differs and the ``op`` it called there (None: it never got there). None when
    every rank agrees on every collective.

    Example::

        >>> first_disagreement({0: {1: "all_reduce", 2: "all_reduce"}, 1: {1: "all_reduce"}})
        {'rank': 1, 'op': None, 'seq': 2, 'expected': 'all_reduce'}
    """
    if not calls:
        return None
    start = max((min(c) for c in calls.values() if c), default=1)  # a ring buffer may have dropped older entries
    end = max((max(c) for c in calls.values() if c), default=0)
    for seq in range(start, end + 1):
        here = {rank: c.get(seq) for rank, c in sorted(calls.items())}
        if len(set(here.values())) == 1:
            continue
        votes = Counter(op for op in here.values() if op is not None)
        top = max(votes.values())
        expected = next(op for op in here.values() if votes.get(op) == top)
        rank = next(r for r, op in here.items() if op != expected)
        return {"rank": rank, "op": here[rank], "seq": seq, "expected": expected}
    return None


def stuck(run) -> dict | None:
    """What the dumps say: {"rank": the rank that stopped, "op": the collective it waited in (None: it called none
    there), "seq": its sequence number, "expected": what the other ranks called there}; None if they all agree."""
    return first_disagreement({rank: collectives(d) for rank, d in dumps(run).items()})


# torch's analyser, run as `python -m` runs it, except that it reads the dumps in rank order: it matches every rank
# against the first dump it reads and blames whoever differs, and it reads them in directory order, which differs
# from one file system to the next (at 4 ranks it blamed ranks 0, 1 and 2 once, having read rank 3 first)
_IN_RANK_ORDER = ("import os, runpy, sys; walk = os.walk; "
                  "os.walk = lambda *a, **k: ((r, sorted(d), sorted(f)) for r, d, f in walk(*a, **k)); "
                  f"sys.argv[0] = {ANALYSER!r}; runpy.run_module({ANALYSER!r}, run_name='__main__', alter_sys=True)")
_analysed: dict[str, str] = {}  # the dumps of a finished run do not change: analyse each folder once


def analyse(run, timeout: float = 120) -> str:
    """The text of torch's analyser on the run's dumps, paths tidied (no absolute path: committed outputs show it)."""
    folder = _run_dir(run) / DUMPS
    if str(folder) not in _analysed:
        done = subprocess.run([sys.executable, "-c", _IN_RANK_ORDER, str(folder), "-p", PREFIX], capture_output=True,
                              text=True, timeout=timeout)
        text = "\n".join(line for line in (done.stdout + done.stderr).splitlines()
                         if "tabulate is not installed" not in line)  # depends on the machine, says nothing here
        for path in (str(folder.resolve()), str(folder)):
            text = text.replace(path, "<run>/" + DUMPS)
        _analysed[str(folder)] = tidy(text)
    return _analysed[str(folder)]


KEEP = ("sequence number", "collective:", "missing ranks:", "expected ranks:", "error msg:", "Culprit")


def excerpt(text: str) -> list[str]:
    """The analyser's lines that tell the story: what it found at which sequence number, who, and the frame of the
    course's script that made the call (the rest of the stack is torch's)."""
    return [line.strip() for line in text.splitlines()
            if any(k in line for k in KEEP) or line.strip().startswith("main at course/")]


def show_analysis(run) -> str:
    """Print the analyser's command and a short excerpt of what it says; return its whole text."""
    text = analyse(run)
    print(f"$ python -m {ANALYSER} <run>/{DUMPS} -p {PREFIX}")
    for line in excerpt(text) or text.splitlines()[-8:]:
        print("   ", line)
    return text


def _told(run) -> tuple[int, int]:
    """(ranks, --steps) the run was launched with, from its env record."""
    record = json.loads((_run_dir(run) / "env.json").read_text())
    args = [str(a) for a in record.get("args", [])]
    steps = int(args[args.index("--steps") + 1]) if "--steps" in args else STEPS
    return int(record["nproc"]) * int(record.get("nnodes", 1)), steps


def injected(scenario: str, nproc: int, steps: int = STEPS) -> dict:
    """What the script was told to get wrong, in :func:`stuck`'s terms: the last rank, always."""
    if scenario == "order":  # after the steps' all_reduces it calls broadcast where the others call all_reduce
        return {"rank": nproc - 1, "op": "broadcast", "seq": steps + 1, "expected": "all_reduce"}
    if scenario == "missing":  # it skips the last step's all_reduce
        return {"rank": nproc - 1, "op": None, "seq": steps, "expected": "all_reduce"}
    raise ValueError(f"unknown scenario {scenario!r}: the script's faults are 'order' and 'missing'")


def claim_desync(run, scenario: str) -> None:
    """The claims on one faulty run: it failed and every rank left a dump; the dumps name the rank and collective
    the script was told to get wrong; torch's analyser names the same."""
    nproc, steps = _told(run)
    want, got = injected(scenario, nproc, steps), stuck(run)
    claim("the run failed instead of hanging, and every rank left its Flight Recorder dump",
          getattr(run, "returncode", 1) != 0 and sorted(dumps(run)) == list(range(nproc)), measured=f"{nproc} ranks")
    said = "none" if got is None else (f"rank {got['rank']}, {got['op']} #{got['seq']}, where the others called "
                                       f"{got['expected']}" if got["op"] else
                                       f"rank {got['rank']} never called {got['expected']} #{got['seq']}")
    if scenario == "order":
        claim("the Flight Recorder dumps name the rank that stopped and the collective it waited in", got == want,
              measured=said)
    else:
        claim("the Flight Recorder dumps name the rank that never joined and the collective the others waited in",
              got == want, measured=said)
    text = analyse(run)
    seq = f"sequence number: {want['seq']}"
    if scenario == "order":
        agrees = seq in text and f"Culprit rank {want['rank']}" in text and "COLLECTIVE_TYPE_MISMATCH" in text
    else:
        agrees = f"Not all ranks joining collective, {seq}" in text and f"missing ranks: {{{want['rank']}}}" in text
    claim("torch's analyser (fr_trace) names the same rank and sequence number", agrees)
