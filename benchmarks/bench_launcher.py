"""How much does helpers.launch.torchrun cost over typing torchrun yourself?

Runs tests/scripts/trivial.py (init, one all-reduce, exit) on N ranks, alternately with

* A: bare ``python -m torch.distributed.run --nproc-per-node N --master-port <free> trivial.py``
  (``subprocess.run``, output captured), and
* B: ``helpers.launch.torchrun(trivial.py, nproc=N, show="none")``,

one warm-up of each first, then interleaved A, B, A, B, ... so machine noise hits both alike. Prints the
median wall time of each, their ratio helpers/bare against the target (<= 1.05x) and PASS/FAIL.

    .venv/bin/python benchmarks/bench_launcher.py            # 5 timed runs of each
    .venv/bin/python benchmarks/bench_launcher.py --runs 9 --strict

Exit code: 0 whatever the verdict, unless --strict (then 1 on FAIL or on a run that errors).
Run directories go to a temporary folder (``$HELPERS_RUNS_DIR``), removed afterwards.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from helpers import launch  # noqa: E402

TARGET = 1.05


def bare(script: Path, nproc: int) -> float:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(launch.free_port()), str(script)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"bare torchrun failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return elapsed


def helpers_run(script: Path, nproc: int) -> float:
    start = time.perf_counter()
    launch.torchrun(script, nproc=nproc, show="none")
    return time.perf_counter() - start


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5, help="timed runs of each launcher (default 5)")
    p.add_argument("--nproc", type=int, default=2, help="ranks per run (default 2)")
    p.add_argument("--script", default=str(ROOT / "tests" / "scripts" / "trivial.py"))
    p.add_argument("--strict", action="store_true", help="exit 1 when the ratio misses the target")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error("--runs must be at least 1")
    script = Path(args.script).resolve()

    runs_dir = tempfile.mkdtemp(prefix="bench_launcher_")
    os.environ["HELPERS_RUNS_DIR"] = runs_dir
    times = {"bare": [], "helpers": []}
    try:
        print(f"launcher overhead: {script.name}, nproc={args.nproc}, {args.runs} timed runs each "
              f"(+1 warm-up), interleaved", flush=True)
        bare(script, args.nproc)
        helpers_run(script, args.nproc)
        for i in range(args.runs):
            times["bare"].append(bare(script, args.nproc))
            times["helpers"].append(helpers_run(script, args.nproc))
            print(f"  run {i + 1}/{args.runs}: bare {times['bare'][-1]:.2f} s   "
                  f"helpers {times['helpers'][-1]:.2f} s", flush=True)
    except Exception as err:  # a broken run is not a timing verdict
        print(f"ERROR: {err}", file=sys.stderr)
        return 1 if args.strict else 0
    finally:
        shutil.rmtree(runs_dir, ignore_errors=True)

    med_bare = statistics.median(times["bare"])
    med_helpers = statistics.median(times["helpers"])
    ratio = med_helpers / med_bare
    verdict = "PASS" if ratio <= TARGET else "FAIL"
    print(f"bare torchrun      median {med_bare:.3f} s  (min {min(times['bare']):.3f}, max {max(times['bare']):.3f})")
    print(f"helpers.torchrun   median {med_helpers:.3f} s  (min {min(times['helpers']):.3f}, "
          f"max {max(times['helpers']):.3f})")
    print(f"ratio helpers/bare {ratio:.3f}x   target <= {TARGET:.2f}x   {verdict}")
    return 1 if args.strict and verdict == "FAIL" else 0


if __name__ == "__main__":
    sys.exit(main())
