"""Who am I? What torchrun tells each process before any distributed code runs.

    torchrun --nproc-per-node 2 course/ddp_basics.py

torchrun starts N copies of this script and tells each one its place through environment
variables. init_process_group reads them to join the group; afterwards dist.get_rank() is the
same number as RANK. Each rank prints one line about itself.
"""
import os
import socket

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from helpers.rank.devices import rank_device
from helpers.rank.metrics import Reporter  # no-op unless HELPERS_RUN_DIR is set
from helpers.rank.runtime import end_rank, launched_ranks


@record
def main() -> int:
    launched_ranks("torchrun --nproc-per-node 2 course/ddp_basics.py")  # run with plain python: say how, and exit
    # Read before init: these are all a process knows about the job until it joins the group.
    env_rank = int(os.environ["RANK"])                          # unique over all nodes: 0 .. WORLD_SIZE-1
    local_rank = int(os.environ["LOCAL_RANK"])                  # unique on this node: picks the GPU
    world_size = int(os.environ["WORLD_SIZE"])                  # processes in the whole job
    local_world_size = int(os.environ["LOCAL_WORLD_SIZE"])      # processes on this node
    # MASTER_ADDR:MASTER_PORT is where rank 0 listens; every rank meets there to find the others.
    master_addr_set = "MASTER_ADDR" in os.environ
    master_port_set = "MASTER_PORT" in os.environ

    device, backend = rank_device(local_rank)  # LOCAL_RANK, not RANK: on node 2, RANK 8 still means GPU 0

    dist.init_process_group(backend)  # "env://": reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        rank_matches = rank == env_rank and world == world_size

        print(f"RANK={env_rank} LOCAL_RANK={local_rank} WORLD_SIZE={world_size} "
              f"LOCAL_WORLD_SIZE={local_world_size} | dist.get_rank()={rank} "
              f"dist.get_world_size()={world} match={rank_matches} | backend={backend} device={device}",
              flush=True)  # pid and hostname go into the result below: they differ on every run
        Reporter(schema=None).result(env_rank=env_rank, local_rank=local_rank, world_size=world_size,
                          local_world_size=local_world_size, master_addr_set=master_addr_set,
                          master_port_set=master_port_set, dist_rank=rank, dist_world_size=world,
                          rank_matches=rank_matches, pid=os.getpid(), hostname=socket.gethostname(),
                          backend=backend, device=str(device))
        return 0 if rank_matches else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    end_rank(main())  # exits without interpreter teardown: see helpers/rank/runtime.py
