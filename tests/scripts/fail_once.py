"""Fixture for max_restarts: rank 1 fails, once or on every attempt.

FAIL_MODE=once (default): the first attempt's rank 1 joins the process group, leaves a marker file in the
run directory ($HELPERS_RUN_DIR) and raises; a restarted attempt finds the marker and runs normally.
FAIL_MODE=always: rank 1 raises on every attempt, before it joins the process group (so no attempt
depends on the one before it).
"""
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from helpers.rank.metrics import Reporter
from helpers.rank.runtime import end_rank


@record
def main():
    rank = int(os.environ["RANK"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    mode = os.environ.get("FAIL_MODE", "once")
    print(f"pid={os.getpid()} rank={rank} attempt={attempt} start", flush=True)
    if mode == "always" and rank == 1:
        raise RuntimeError(f"planned failure of rank 1 on attempt {attempt}")
    dist.init_process_group("gloo")
    marker = Path(os.environ["HELPERS_RUN_DIR"]) / "failed_once.marker"
    if rank == 1 and not marker.exists():
        marker.write_text(str(os.getpid()))
        raise RuntimeError("planned failure on the first attempt")
    t = torch.ones(1)
    dist.all_reduce(t)
    Reporter(schema=None).result(attempt=attempt, sum=t.item())
    print(f"rank {rank} done sum={t.item():.0f}", flush=True)
    dist.destroy_process_group()


end_rank(main())
