"""Which samples does each rank see? DistributedSampler, padding, and why set_epoch matters.

    torchrun --nproc-per-node 2 course/sampler_demo.py
    torchrun --nproc-per-node 2 course/sampler_demo.py --num-samples 21  # not divisible: padding
    torchrun --nproc-per-node 2 course/sampler_demo.py --no-set-epoch    # the classic bug

Each rank builds the same dataset and its own DistributedSampler, then records the indices its
DataLoader yields in each epoch. All ranks share their lists, and rank 0 checks: are the shards
disjoint, do they cover the dataset, and does the order change from one epoch to the next?
"""
import argparse
from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from helpers.rank.devices import rank_device
from helpers.rank.metrics import Reporter  # no-op unless HELPERS_RUN_DIR is set
from helpers.rank.runtime import end_rank, launched_ranks


@record
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # Not "--n": torchrun's parser takes any prefix of its own options (--nnodes...) as its own.
    parser.add_argument("--num-samples", type=int, default=20, help="dataset size")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-set-epoch", action="store_true", help="forget sampler.set_epoch(epoch)")
    args = parser.parse_args()

    rank, local_rank, world = launched_ranks("torchrun --nproc-per-node 2 course/sampler_demo.py")
    _, backend = rank_device(local_rank)  # sets the GPU: all_gather_object moves its buffers to it
    dist.init_process_group(backend)
    try:
        dataset = TensorDataset(torch.arange(args.num_samples))  # sample i is just the number i
        # num_replicas and rank come from the process group. The seed must be the same on every
        # rank: all ranks draw the same permutation, then each keeps every world-th index of it.
        sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed)
        # The sampler replaces shuffle=True on the DataLoader: the two are mutually exclusive.
        loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

        shards_by_epoch = []  # [epoch][rank] -> indices that rank saw, in order
        for epoch in range(args.epochs):
            if not args.no_set_epoch:
                # The permutation is seeded with seed + epoch. Without this call, epoch stays 0
                # and every epoch repeats the same order.
                sampler.set_epoch(epoch)
            mine = [int(i) for (batch,) in loader for i in batch]
            everyone = [None] * world
            dist.all_gather_object(everyone, mine)  # so every rank can check the whole picture
            shards_by_epoch.append(everyone)

        # drop_last=False (the default) pads: the sampler repeats indices from the start of the
        # permutation until every rank has ceil(n / world) of them, so all ranks run the same
        # number of steps (a rank with fewer batches would leave the others waiting in all_reduce).
        padded = len(sampler) * world - args.num_samples
        # per epoch: the indices that more than one rank saw (only padding can cause that)
        repeated = [sorted(i for i, c in Counter(i for s in shards for i in s).items() if c > 1)
                    for shards in shards_by_epoch]
        disjoint = not any(repeated)
        everything = set(range(args.num_samples))
        covers = all(set().union(*map(set, shards)) == everything for shards in shards_by_epoch)
        epochs_differ = args.epochs > 1 and shards_by_epoch[0] != shards_by_epoch[1]

        if rank == 0:
            for epoch, shards in enumerate(shards_by_epoch):
                for r, shard in enumerate(shards):
                    print(f"epoch {epoch} rank {r}: {shard}", flush=True)
            print(f"num_samples={args.num_samples} world={world} per_rank={len(sampler)} "
                  f"set_epoch={not args.no_set_epoch} | disjoint={disjoint} covers={covers} padded={padded} "
                  f"repeated={repeated} "
                  f"epochs_differ={epochs_differ}", flush=True)
        Reporter(schema=None).result(num_samples=args.num_samples, world_size=world, set_epoch=not args.no_set_epoch,
                          seed=args.seed, per_rank=len(sampler), shards_by_epoch=shards_by_epoch,
                          my_shards=[shards[rank] for shards in shards_by_epoch], disjoint=disjoint,
                          covers=covers, padded=padded, repeated=repeated, epochs_differ=epochs_differ)
        return 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    end_rank(main())  # exits without interpreter teardown: see helpers/rank/runtime.py
