"""How fast is an all-reduce here? A small nccl-tests-style sweep over message sizes.

    torchrun --nproc-per-node 2 course/allreduce_bench.py --max-bytes 64MiB

For each size: warm up, then time ``--iters`` all-reduces of a float32 tensor between two barriers.
The slowest rank's time counts (a collective is done when every rank is done). Bandwidths follow
nccl-tests: algbw = size / time, busbw = algbw * 2(n-1)/n (see helpers.calc.comm.bus_bandwidth).
Small messages measure latency; large ones approach the link's bandwidth.
"""
import argparse
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from helpers.calc.comm import bus_bandwidth
from helpers.rank.devices import rank_device
from helpers.rank.metrics import Reporter
from helpers.rank.runtime import end_rank, launched_ranks

UNITS = {"kib": 1024, "mib": 1024 ** 2, "gib": 1024 ** 3, "kb": 1000, "mb": 1000 ** 2, "gb": 1000 ** 3, "b": 1}


def parse_size(text: str) -> int:
    """'16MiB' -> 16777216; plain numbers are bytes."""
    t = text.strip().lower()
    for unit, factor in UNITS.items():
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * factor)
    return int(t)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # CUDA collectives return before the GPU has finished
    dist.barrier()


@record
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-bytes", type=parse_size, default=parse_size("1KiB"))
    parser.add_argument("--max-bytes", type=parse_size, default=parse_size("16MiB"))
    parser.add_argument("--factor", type=int, default=4, help="size multiplier between steps")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()

    rank, local_rank, world = launched_ranks("torchrun --nproc-per-node 2 course/allreduce_bench.py")
    device, backend = rank_device(local_rank)
    dist.init_process_group(backend)
    try:
        sizes, size = [], args.min_bytes
        while size <= args.max_bytes:
            sizes.append(size)
            size *= args.factor
        rep, best = Reporter(schema=None), 0.0
        if rank == 0:
            rep.total(len(sizes))
            print(f"all-reduce SUM, float32, {world} ranks, backend {backend}, {args.iters} iters after "
                  f"{args.warmup} warm-up\n{'size (B)':>12} {'time (us)':>12} {'algbw (GB/s)':>13} {'busbw (GB/s)':>13}")
        for i, size_bytes in enumerate(sizes):
            x = torch.ones(size_bytes // 4, dtype=torch.float32, device=device)
            for _ in range(args.warmup):
                dist.all_reduce(x)
            sync(device)
            t0 = time.perf_counter()
            for _ in range(args.iters):
                dist.all_reduce(x)
            sync(device)
            elapsed = torch.tensor([(time.perf_counter() - t0) / args.iters], dtype=torch.float64, device=device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            seconds = elapsed.item()
            algbw, busbw = bus_bandwidth(x.numel() * 4, seconds, world)
            best = max(best, busbw)
            if rank == 0:
                print(f"{x.numel() * 4:>12} {seconds * 1e6:>12.1f} {algbw:>13.3f} {busbw:>13.3f}", flush=True)
                rep.step(i, size_bytes=x.numel() * 4, seconds=seconds, algbw_gbs=algbw, busbw_gbs=busbw)
        if rank == 0:
            rep.result(world_size=world, backend=backend, max_busbw_gbs=best, max_size_bytes=sizes[-1])
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    end_rank(main())  # exits without interpreter teardown: see helpers/rank/runtime.py
