"""What do two launches side by side save on this machine, against the same launches one after another?

Runs K short training runs of chapter 05 (course/ddp_tuning.py, SimpleCNN on generated data, 2 ranks each) one
after another (A) and through ``launch.side_by_side`` (B), alternately ``--rounds`` times so that machine noise hits
both alike. Prints the wall time of every round, the median of each and their ratio B / A. Speed targets live here,
not in a timed test: the chapters use side_by_side only where they read no timing.

    .venv/bin/python benchmarks/bench_side_by_side.py              # 4 runs per round, 3 rounds
    .venv/bin/python benchmarks/bench_side_by_side.py --runs 6 --rounds 5

Run directories go to a temporary folder (``$HELPERS_RUNS_DIR``), removed afterwards.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from helpers import launch  # noqa: E402

ARGS = ["--dataset", "synthetic", "--train-size", 2560, "--steps", 40, "--batch-size", 32, "--test-size", 64,
        "--optimizer", "sgd", "--lr", 0.05]


def one_round(runs: int, limit: int) -> float:
    calls = [lambda i=i: launch.torchrun("course/ddp_tuning.py", 2, ARGS + ["--seed", i], name=f"bench_sbs_{i}",
                                         show="none") for i in range(runs)]
    start = time.perf_counter()
    launch.side_by_side(*calls, limit=limit)
    return time.perf_counter() - start


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=4, help="launches per round (default 4)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of each way (default 3)")
    args = p.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="bench_sbs_")
    os.environ["HELPERS_RUNS_DIR"] = tmp
    try:
        times = {"one after another": [], "side by side": []}
        for _ in range(args.rounds):
            for label, limit in (("one after another", 1), ("side by side", launch.together.at_once())):
                times[label].append(one_round(args.runs, limit))
                print(f"{label:18s} {times[label][-1]:6.1f} s", flush=True)
        med = {k: statistics.median(v) for k, v in times.items()}
        for k, v in times.items():
            print(f"{k:18s} median {med[k]:6.1f} s (min {min(v):.1f}, max {max(v):.1f}) for {args.runs} launches")
        print(f"side by side / one after another: {med['side by side'] / med['one after another']:.2f} "
              f"({launch.together.at_once()} at a time here)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
