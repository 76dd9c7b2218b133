"""What does a `deepspeed` launch cost over a `torchrun` launch of the same script?

Runs course/ds_cifar10.py (ZeRO stage 0, two steps of the CNN on 64 synthetic images: start-up dominates) on N
ranks, interleaved so machine noise hits each alike, after one warm-up of each:

* ``torchrun``: ``helpers.launch.torchrun`` (the script's ``deepspeed.init_distributed`` reads torchrun's variables);
* ``deepspeed``: ``helpers.launch.deepspeed``, DeepSpeed's per-node launcher run directly (one interpreter);
* ``deepspeed CLI``: ``deepspeed --num_gpus N`` typed in a terminal: the runner, which starts that per-node launcher
  as a second interpreter (what helpers.launch.deepspeed ran until it ran the per-node launcher itself).

Prints each one's median wall time with its spread (min, max), and the ratios deepspeed/torchrun (target <= 1.3x)
and deepspeed CLI/torchrun, measured side by side in this run.

    .venv/bin/python benchmarks/bench_ds_startup.py             # 3 timed runs of each
    .venv/bin/python benchmarks/bench_ds_startup.py --runs 5 --strict

Exit code: 0 whatever the verdict, unless --strict (then 1 on a missed target or a run that errors).
"""
from __future__ import annotations

import argparse
import json
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
from helpers.rank.deepspeed_facts import build_config  # noqa: E402

TARGET = 1.3
SCRIPT = ROOT / "course" / "ds_cifar10.py"
ARGS = ["--steps", 2, "--dataset", "synthetic", "--train-size", 64, "--test-size", 64]


def _config(nproc: int) -> dict:
    return build_config(stage=0, dtype="fp32", micro_batch=32, accumulation=1, world_size=nproc)


def _config_file(nproc: int) -> Path:
    cfg = Path(tempfile.mkstemp(suffix=".json", dir=os.environ["HELPERS_RUNS_DIR"])[1])
    cfg.write_text(json.dumps(_config(nproc)))
    return cfg


def via_torchrun(nproc: int) -> float:
    cfg = _config_file(nproc)
    start = time.perf_counter()
    launch.torchrun(SCRIPT, nproc=nproc, args=[*ARGS, "--deepspeed_config", cfg], show="none")
    return time.perf_counter() - start


def via_deepspeed(nproc: int) -> float:
    start = time.perf_counter()
    launch.deepspeed(SCRIPT, nproc=nproc, config=_config(nproc), args=ARGS, show="none")
    return time.perf_counter() - start


def via_cli(nproc: int) -> float:
    cfg = _config_file(nproc)
    cmd = [sys.executable, "-c", "from deepspeed.launcher.runner import main; main()", "--num_gpus", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(launch.free_port()), str(SCRIPT),
           *map(str, ARGS), "--deepspeed_config", str(cfg)]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": str(max(1, launch.cpu_count() // nproc))}
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"deepspeed CLI failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return elapsed


WAYS = {"torchrun": via_torchrun, "deepspeed": via_deepspeed, "deepspeed CLI": via_cli}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3, help="timed runs of each way (default 3)")
    p.add_argument("--nproc", type=int, default=2, help="ranks per run (default 2)")
    p.add_argument("--strict", action="store_true", help="exit 1 when the ratio misses the target")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error("--runs must be at least 1")

    runs_dir = tempfile.mkdtemp(prefix="bench_ds_startup_")
    os.environ["HELPERS_RUNS_DIR"] = runs_dir
    times = {way: [] for way in WAYS}
    try:
        print(f"start-up: {SCRIPT.relative_to(ROOT)} (stage 0, 2 steps), nproc={args.nproc}, {args.runs} timed runs "
              f"of each (+1 warm-up), interleaved", flush=True)
        for way in WAYS.values():
            way(args.nproc)
        for i in range(args.runs):
            for name, way in WAYS.items():
                times[name].append(way(args.nproc))
            print(f"  run {i + 1}/{args.runs}: " + "   ".join(f"{n} {t[-1]:.2f} s" for n, t in times.items()),
                  flush=True)
    except Exception as err:  # a broken run is not a timing verdict
        print(f"ERROR: {err}", file=sys.stderr)
        return 1 if args.strict else 0
    finally:
        shutil.rmtree(runs_dir, ignore_errors=True)

    med = {n: statistics.median(t) for n, t in times.items()}
    for n, t in times.items():
        print(f"{n:14s} median {med[n]:.2f} s  (min {min(t):.2f}, max {max(t):.2f})")
    ratio = med["deepspeed"] / med["torchrun"]
    verdict = "PASS" if ratio <= TARGET else "FAIL"
    print(f"ratio deepspeed/torchrun {ratio:.2f}x   target <= {TARGET:.1f}x   {verdict}")
    print(f"ratio deepspeed CLI/torchrun {med['deepspeed CLI'] / med['torchrun']:.2f}x   (the runner's extra "
          f"interpreter: {med['deepspeed CLI'] - med['deepspeed']:+.2f} s)")
    return 1 if args.strict and verdict == "FAIL" else 0


if __name__ == "__main__":
    sys.exit(main())
