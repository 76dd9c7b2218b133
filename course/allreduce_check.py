"""Can every rank talk to every other rank? The smallest distributed program worth running.

    torchrun --nproc-per-node 2 course/allreduce_check.py

Each rank contributes (rank + 1); after an all-reduce SUM every rank must hold 1 + 2 + ... + n =
n(n+1)/2. Then rank 0 broadcasts a value and every rank must receive it. One line per rank says
where it ran and whether it agreed. Exit code 1 if any rank disagrees.
"""
import argparse
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from helpers.rank.devices import rank_device
from helpers.rank.metrics import Reporter  # no-op unless HELPERS_RUN_DIR is set
from helpers.rank.runtime import end_rank, launched_ranks


@record
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout-s", type=int, default=120, help="give up if a rank does not show up")
    args = parser.parse_args()

    # torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT for every process it starts.
    rank, local_rank, world = launched_ranks("torchrun --nproc-per-node 2 course/allreduce_check.py")
    # GPU number LOCAL_RANK and NCCL, else CPU and gloo; set_device: without it every rank piles onto cuda:0
    device, backend = rank_device(local_rank)
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout_s))
    try:
        x = torch.full((4,), float(rank + 1), device=device)
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
        expected = world * (world + 1) / 2
        allreduce_ok = bool(torch.all(x == expected))

        y = torch.full((4,), 42.0 if rank == 0 else -1.0, device=device)
        dist.broadcast(y, src=0)
        broadcast_ok = bool(torch.all(y == 42.0))

        # Agree on the outcome, so rank 0 can vouch for everyone (MIN of 1s and 0s is "all").
        ok = torch.tensor([int(allreduce_ok and broadcast_ok)], device=device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        hosts = [None] * world
        dist.all_gather_object(hosts, socket.gethostname())

        status = "OK" if allreduce_ok and broadcast_ok else "MISMATCH"
        print(f"{socket.gethostname()}:{rank}/{world} local_rank={local_rank} backend={backend} device={device} "
              f"all_reduce={x[0].item():g} expected={expected:g} broadcast={y[0].item():g} {status}", flush=True)
        Reporter(schema=None).result(host=socket.gethostname(), rank=rank, local_rank=local_rank, world_size=world,
                          backend=backend, device=str(device), all_reduce=x[0].item(), expected=expected,
                          allreduce_ok=allreduce_ok, broadcast_ok=broadcast_ok, all_ranks_ok=bool(ok.item()),
                          hosts=sorted(set(hosts)))
        return 0 if ok.item() else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    end_rank(main())  # exits without interpreter teardown: see helpers/rank/runtime.py
