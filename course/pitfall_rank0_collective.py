"""Pitfall: a collective that only some ranks call. This script hangs on purpose.

    torchrun --nproc-per-node 2 course/pitfall_rank0_collective.py        # hangs: press Ctrl-C
    torchrun --nproc-per-node 2 course/pitfall_rank0_collective.py --fixed
    torchrun --nproc-per-node 2 course/pitfall_rank0_collective.py --timeout-s 10   # fails after 10 s instead

A collective (all_reduce, barrier, broadcast, ...) is a meeting: it returns only when EVERY rank of the
group has called it. Here rank 0 wants the average loss for its log line and calls all_reduce inside
`if rank == 0:`; rank 1 never makes that call and waits at the next meeting instead (a barrier). Each
waits for the other forever. --fixed moves the all_reduce out of the `if`: every rank calls it, and
only the printing stays on rank 0.
"""
import argparse
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from helpers.rank.devices import rank_device
from helpers.rank.runtime import end_rank, launched_ranks


@record
def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixed", action="store_true", help="call the all_reduce on every rank")
    parser.add_argument("--timeout-s", type=float, default=None,
                        help="how long a collective may wait before it raises (default: 30 min for gloo, 10 for NCCL)")
    args = parser.parse_args()
    fixed = args.fixed
    timeout = timedelta(seconds=args.timeout_s) if args.timeout_s else None
    rank, local_rank, _ = launched_ranks("torchrun --nproc-per-node 2 course/pitfall_rank0_collective.py")
    device, backend = rank_device(local_rank)
    dist.init_process_group(backend, timeout=timeout)
    try:
        loss = torch.tensor([1.0 + rank], device=device)  # pretend each rank computed its own loss
        if fixed:
            dist.all_reduce(loss)  # every rank takes part ...
            if rank == 0:          # ... and only the printing is rank 0's
                print(f"mean loss {loss.item() / dist.get_world_size():.2f}", flush=True)
        elif rank == 0:
            print("rank 0: all_reduce for the log line (rank 1 never joins)", flush=True)
            dist.all_reduce(loss)  # BUG: only rank 0 gets here
            print(f"mean loss {loss.item() / dist.get_world_size():.2f}", flush=True)
        print(f"rank {rank}: waiting at the barrier", flush=True)
        dist.barrier()
        print(f"rank {rank}: past the barrier", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    end_rank(main())  # exits without interpreter teardown: see helpers/rank/runtime.py
