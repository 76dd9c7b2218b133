"""Fixture: two ranks print in a fixed interleaved order (rank 1, rank 0 twice, rank 1 twice), held in order by
barriers and a pause for each line to reach the launcher."""
import os
import time

import torch.distributed as dist

from helpers.rank.runtime import end_rank


def say(text):
    print(f"interleave {text}", flush=True)
    time.sleep(0.3)  # the launcher reads each rank's output separately: let this line arrive first


dist.init_process_group("gloo")
rank = int(os.environ["RANK"])
if rank == 1:
    say("rank 1, first")
dist.barrier()
if rank == 0:
    say("rank 0, second")
    say("rank 0, third")
dist.barrier()
if rank == 1:
    say("rank 1, fourth")
    say("rank 1, fifth")
dist.barrier()
dist.destroy_process_group()
end_rank()
