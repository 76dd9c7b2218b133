"""Fixture: each rank reports the environment the launcher gave it (no process group needed)."""
import os

import torch

from helpers.rank.metrics import Reporter

rank = int(os.environ["RANK"])
print(f"pid={os.getpid()} rank={rank} OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}", flush=True)
Reporter(schema=None).result(
    omp_num_threads=os.environ.get("OMP_NUM_THREADS"),
    torch_threads=torch.get_num_threads(),
    ds_accelerator=os.environ.get("DS_ACCELERATOR"),
    run_dir=os.environ.get("HELPERS_RUN_DIR"),
    world_size=int(os.environ["WORLD_SIZE"]),
)
