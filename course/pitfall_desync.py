"""Pitfall: ranks that disagree about the next collective, and the Flight Recorder that says which rank and where.

    torchrun --nproc-per-node 2 course/pitfall_desync.py --scenario order     # fails after 5 s, dumps in fr/
    torchrun --nproc-per-node 3 course/pitfall_desync.py --scenario missing
    python -m torch.distributed.flight_recorder.fr_trace fr -p fr_rank       # torch's analyser reads the dumps

Each rank numbers its collectives 1, 2, 3, ... (the sequence number); the n-th collective of every rank meets the
n-th of the others, so it must be the same operation. `order`: the last rank calls broadcast where the others call
all_reduce. `missing`: the last rank skips the last step's all_reduce (a `continue` before the sync) and the others
wait in it. `none`: every rank agrees. Either fault hangs until the --timeout-s of init_process_group.

The Flight Recorder is a ring buffer of each rank's collectives (name, sequence number, sizes, Python stack), on
when TORCH_FR_BUFFER_SIZE is set before init_process_group. With NCCL, TORCH_NCCL_DUMP_ON_TIMEOUT=1 has the watchdog
write it to $TORCH_FR_DUMP_TEMP_FILE<rank> on a timeout. gloo (torch 2.14) has no watchdog and writes nothing itself,
so each rank here writes its own as it leaves, with torch's private _dump_fr_trace(): the same pickle and file name.
"""
import argparse
import os
import pickle
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from helpers.rank.metrics import RUN_DIR_ENV
from helpers.rank.runtime import end_rank, launched_ranks

PREFIX = "fr_rank"  # the file name before the rank: what the analyser's -p strips to read the rank


def dump_path(rank: int) -> Path:
    """$TORCH_FR_DUMP_TEMP_FILE<rank> (NCCL's name), else <run dir>/fr/fr_rank<rank> (from a terminal: ./fr/)."""
    prefix = os.environ.get("TORCH_FR_DUMP_TEMP_FILE") or str(Path(os.environ.get(RUN_DIR_ENV) or ".") / "fr" / PREFIX)
    return Path(f"{prefix}{rank}")


def dump_flight_recorder(rank: int) -> Path:
    """Write this rank's Flight Recorder buffer (a pickle: version, pg_config, entries) where the analyser reads it."""
    # collectives, their Python stacks, all of them (not only the unfinished: the analyser matches from the start)
    dump = pickle.loads(torch._C._distributed_c10d._dump_fr_trace(True, True, False))
    # torch 2.14's gloo records its group before the group is named (pg_config {'': {'name': '', ...}}): the analyser
    # then finds no group for the entries' ('0', 'default_pg') and stops with a KeyError. Name it from the entries.
    for name, desc in {tuple(e["process_group"]) for e in dump["entries"]}:
        if "" in dump["pg_config"] and name not in dump["pg_config"]:
            dump["pg_config"][name] = {**dump["pg_config"].pop(""), "name": name, "desc": desc}
    path = dump_path(rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.parent / f".partial{rank}"  # whole or absent: a reader never sees half a pickle
    partial.write_bytes(pickle.dumps(dump))
    partial.replace(path)
    return path


def wait_for_dumps(world_size: int, seconds: float) -> None:
    """The group is broken, so the ranks meet in the dump folder instead: a rank that failed and left first would make
    torchrun stop the others before they wrote theirs (and one that left early would end their wait early)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not all(dump_path(r).exists() for r in range(world_size)):
        time.sleep(0.1)


@record
def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=("order", "missing", "none"), default="order",
                        help="order: the last rank swaps two collectives; missing: it skips the last step's all_reduce")
    parser.add_argument("--steps", type=int, default=4, help="ordinary steps (one all_reduce each) before the fault")
    parser.add_argument("--timeout-s", type=float, default=5.0, help="how long a collective waits before it raises")
    parser.add_argument("--no-dump", action="store_true",
                        help="leave the dump to torch (which, on gloo, writes none: tests/test_flight_recorder.py)")
    args = parser.parse_args()
    rank, _, world_size = launched_ranks("torchrun --nproc-per-node 2 course/pitfall_desync.py --scenario order")
    last = world_size - 1  # the rank with the bug, at any number of ranks
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")  # read when the group is made: before init_process_group
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout_s))  # gloo's recorder: CPU ranks
    grad = torch.ones(4)
    try:
        for step in range(args.steps):
            if args.scenario == "missing" and rank == last and step == args.steps - 1:
                print(f"rank {rank}: step {step}: skipping the all_reduce (BUG)", flush=True)
                continue
            dist.all_reduce(grad)  # the gradient sync of one step: every rank, every step
        if args.scenario == "order" and rank == last:
            print(f"rank {rank}: broadcast, then all_reduce (BUG: the others call all_reduce first)", flush=True)
            dist.broadcast(grad, src=0)
            dist.all_reduce(grad)
        elif args.scenario == "order":
            dist.all_reduce(grad)
            dist.broadcast(grad, src=0)
        print(f"rank {rank}: done", flush=True)
    finally:  # on the error too: the dump is what this lesson reads
        if not args.no_dump:
            print(f"rank {rank}: Flight Recorder written to {dump_flight_recorder(rank)}", flush=True)
            wait_for_dumps(world_size, args.timeout_s + 10)
        dist.destroy_process_group()


if __name__ == "__main__":
    end_rank(main())  # exits without interpreter teardown: see helpers/rank/runtime.py
