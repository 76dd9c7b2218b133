"""The collectives DDP and ZeRO are built from, each checked against what it must produce.

    torchrun --nproc-per-node 2 course/collectives.py

Every rank works out the expected result from its rank and the world size alone, so a wrong
answer on any rank is caught on that rank. A collective is a meeting: every rank must call it,
in the same order, or the ones that did wait forever.
"""
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from helpers.rank.devices import rank_device
from helpers.rank.metrics import Reporter  # no-op unless HELPERS_RUN_DIR is set
from helpers.rank.runtime import end_rank, launched_ranks


def show(name: str, got, expected) -> bool:
    ok = got == expected
    print(f"{name:<16} got {got}  expected {expected}  {'OK' if ok else 'MISMATCH'}", flush=True)
    return ok


@record
def main() -> int:
    rank, local_rank, world = launched_ranks("torchrun --nproc-per-node 2 course/collectives.py")
    device, backend = rank_device(local_rank)
    dist.init_process_group(backend)
    try:
        facts = {"world_size": world, "backend": backend}

        def tensor(values):  # int64, so results print as 3 rather than 3.0
            return torch.tensor(values, dtype=torch.int64, device=device)

        # all_reduce: everyone contributes, everyone ends with the combined value (in place).
        # DDP does exactly this with gradients (SUM, then divide by world size).
        x = tensor([rank + 1])
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
        facts["all_reduce_sum"] = x.tolist()
        facts["all_reduce_sum_ok"] = show("all_reduce SUM", x.tolist(), [world * (world + 1) // 2])
        x = tensor([rank + 1])
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
        facts["all_reduce_max"] = x.tolist()
        facts["all_reduce_max_ok"] = show("all_reduce MAX", x.tolist(), [world])

        # broadcast: one rank's tensor overwrites everyone's. DDP uses it to start all replicas
        # from rank 0's weights.
        b = tensor([3, 1, 4]) if rank == 0 else tensor([0, 0, 0])
        dist.broadcast(b, src=0)
        facts["broadcast"] = b.tolist()
        facts["broadcast_ok"] = show("broadcast src=0", b.tolist(), [3, 1, 4])

        # all_gather: everyone ends with everyone's piece, in rank order. ZeRO-3 gathers
        # parameter shards this way just before a layer needs them.
        pieces = [tensor([0, 0]) for _ in range(world)]
        dist.all_gather(pieces, tensor([rank, rank * 10]))
        facts["all_gather"] = [p.tolist() for p in pieces]
        facts["all_gather_ok"] = show("all_gather", facts["all_gather"], [[r, r * 10] for r in range(world)])

        # reduce_scatter: an all_reduce where rank j keeps only chunk j of the sum. ZeRO-2 reduces
        # gradients this way, so each rank holds only the part its optimizer shard updates.
        contribution = (rank + 1) * torch.arange(2 * world, dtype=torch.int64, device=device)
        mine = tensor([0, 0])
        expected = [world * (world + 1) // 2 * i for i in (2 * rank, 2 * rank + 1)]
        try:
            dist.reduce_scatter(mine, list(contribution.chunk(world)), op=dist.ReduceOp.SUM)
            facts["reduce_scatter"] = mine.tolist()
            facts["reduce_scatter_ok"] = show("reduce_scatter", mine.tolist(), expected)
            facts["reduce_scatter_skipped"] = None
        except (RuntimeError, NotImplementedError) as e:  # older gloo builds lack it for CPU tensors
            reason = str(e).strip().splitlines()[0]
            print(f"{'reduce_scatter':<16} skipped: {backend} says: {reason}", flush=True)
            facts.update(reduce_scatter=None, reduce_scatter_ok=None, reduce_scatter_skipped=reason)

        # scatter: rank 0 hands out one different piece to each rank (the opposite of gather).
        piece = tensor([0, 0])
        dist.scatter(piece, [tensor([100 * r, 100 * r + 1]) for r in range(world)] if rank == 0 else None, src=0)
        facts["scatter"] = piece.tolist()
        facts["scatter_ok"] = show("scatter src=0", piece.tolist(), [100 * rank, 100 * rank + 1])

        # barrier: nobody leaves before the last one arrives. Rank r arrives r*0.5 s late.
        time.sleep(rank * 0.5)
        arrived = time.time()
        dist.barrier()
        left = time.time()
        # Gather everyone's times to check: the earliest departure is after the latest arrival.
        # (time.time() is one clock for ranks on one machine; across nodes clocks can drift.)
        times = [None] * world
        dist.all_gather_object(times, (arrived, left))
        last_arrival = max(a for a, _ in times)
        barrier_ok = all(l >= last_arrival for _, l in times)
        print(f"{'barrier':<16} arrived +{arrived - times[0][0]:.2f}s, left +{left - times[0][0]:.2f}s "
              f"(last rank arrived +{last_arrival - times[0][0]:.2f}s)  {'OK' if barrier_ok else 'MISMATCH'}",
              flush=True)
        facts.update(barrier_arrived=arrived, barrier_left=left, barrier_waited_s=left - arrived,
                     barrier_arrivals=[a for a, _ in times], barrier_departures=[l for _, l in times],
                     barrier_ok=barrier_ok)

        checks = [v for k, v in facts.items() if k.endswith("_ok") and v is not None]
        facts["all_ok"] = all(checks)
        Reporter(schema=None).result(**facts)
        return 0 if facts["all_ok"] else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    end_rank(main())  # exits without interpreter teardown: see helpers/rank/runtime.py
