"""Fixture for launcher tests: a rank loop with injectable faults.

FAULT_RANK / FAULT_STEP / FAULT_KIND (raise | hang | exit) choose the fault; STEPS and STEP_S the work.
Every rank all-reduces each step, so a dead or hung rank really blocks the others.
"""
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from helpers.rank.metrics import Reporter
from helpers.rank.runtime import end_rank


@record
def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    steps = int(os.environ.get("STEPS", "5"))
    step_s = float(os.environ.get("STEP_S", "0.05"))
    fault_rank = int(os.environ.get("FAULT_RANK", "-1"))
    fault_step = int(os.environ.get("FAULT_STEP", "-1"))
    kind = os.environ.get("FAULT_KIND", "raise")
    rep = Reporter(schema=None)
    rep.total(steps)
    print(f"pid={os.getpid()} rank={rank} start", flush=True)
    try:
        for step in range(steps):
            if rank == fault_rank and step == fault_step:
                if kind == "raise":
                    raise RuntimeError(f"injected fault on rank {rank} at step {step}")
                if kind == "hang":
                    print(f"rank {rank} hanging at step {step}", flush=True)
                    time.sleep(3600)
                if kind == "exit":
                    os._exit(3)
            t = torch.ones(4) * (rank + 1)
            dist.all_reduce(t)
            time.sleep(step_s)
            rep.step(step + 1, value=t[0].item())  # numbered from 1, as in every course script
            print(f"rank {rank} step {step} sum={t[0].item():.0f}", flush=True)
        rep.result(steps_done=steps, world_size=dist.get_world_size())
    finally:
        dist.destroy_process_group()


end_rank(main())
