"""Gradient accumulation with DDP: do N micro batches give the gradient of one big batch, and what does no_sync() save?

    torchrun --nproc-per-node 2 course/ddp_accumulation_check.py --micro-batches 4 --batch-size 16

From the same weights, each rank computes the gradient of the same N x B images (its shard) three ways:

    big batch     one forward/backward over all N x B images
    no_sync       N micro batches of B; no_sync() on all but the last, so DDP all-reduces once
    every step    N micro batches of B without no_sync(): DDP all-reduces after every micro batch

Each micro batch's loss is divided by N, so the micro gradients add up to the big batch's mean gradient. A DDP
communication hook counts the all-reduce calls and bytes of each way. Every rank reports the largest difference
between its gradients and the big batch's. (Models with BatchNorm would differ: micro batches see other statistics.)
Each way is timed --repeats times, the three ways taking turns, after one untimed warm-up; the result holds the
median seconds and the spread (min, max) of each.
"""
import argparse
import contextlib
import copy
import gc
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers.rank.data import get_datasets
from helpers.rank.harness import count_ddp_comms
from helpers.rank.metrics import Reporter
from helpers.rank.models import SimpleCNN
from helpers.rank.runtime import end_rank, launched_ranks, log0


def parse_args():
    p = argparse.ArgumentParser(description="N accumulated micro batches vs one big batch, under DDP.")
    p.add_argument("--micro-batches", type=int, default=4, help="N: micro batches per optimizer step")
    p.add_argument("--batch-size", type=int, default=16, help="B: images per micro batch per rank")
    p.add_argument("--repeats", type=int, default=5, help="timed repetitions of each way (median and spread reported)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dataset", choices=["auto", "cifar10", "synthetic"], default="synthetic")
    p.add_argument("--data-root", default="data")
    return p.parse_args()


def gradient(ddp, counter, images, labels, micro_batches, use_no_sync):
    """The averaged gradient after N micro batches (N=1: one big batch), plus the all-reduces it took."""
    for p in ddp.parameters():
        p.grad = None
    if counter is not None:
        counter.reset()
    start = time.perf_counter()
    for i, (x, y) in enumerate(zip(images.chunk(micro_batches), labels.chunk(micro_batches))):
        last = i == micro_batches - 1
        with ddp.no_sync() if use_no_sync and not last else contextlib.nullcontext():
            (F.cross_entropy(ddp(x), y) / micro_batches).backward()
    grads = torch.cat([p.grad.flatten() for p in ddp.parameters()])
    counts = counter.counts["all_reduce"] if counter is not None else {}
    return grads, dict(counts, seconds=time.perf_counter() - start)


@record
def main():
    args = parse_args()
    rank, _, world_size = launched_ranks("torchrun --nproc-per-node 2 course/ddp_accumulation_check.py")
    dist.init_process_group("gloo")  # a correctness check: CPU and gloo on any machine
    rep = Reporter(schema=None)  # a check of its own, not a training run: its fields are its own
    torch.manual_seed(args.seed)
    n, b = args.micro_batches, args.batch_size
    train_ds, _, info = get_datasets(args.dataset, args.data_root, n * b * world_size, 100, args.seed)
    mine = range(rank * n * b, (rank + 1) * n * b)  # this rank's shard of one global batch
    images = torch.stack([train_ds[i][0] for i in mine])
    labels = torch.tensor([train_ds[i][1] for i in mine])

    ddp = DDP(SimpleCNN(info.num_classes))
    counter = count_ddp_comms(ddp)  # a comm hook DDP calls once per gradient bucket: count, then all-reduce
    gradient(ddp, counter, images, labels, 1, False)  # warm-up: DDP re-orders its buckets after the first backward
    ways = {"big batch": (1, False), "no_sync": (n, True), "every step": (n, False)}
    grads, comm, seconds = {}, {}, {way: [] for way in ways}
    for _ in range(max(1, args.repeats)):  # the ways take turns, so a slow moment of the machine hits all of them
        for way, (micro, use_no_sync) in ways.items():
            grads[way], comm[way] = gradient(ddp, counter, images, labels, micro, use_no_sync)
            seconds[way].append(comm[way]["seconds"])
    for way, times in seconds.items():  # calls and bytes are the same every time; the clock is not
        times = sorted(times)
        comm[way].update(seconds=times[len(times) // 2], seconds_min=times[0], seconds_max=times[-1])
    big, no_sync, every = grads["big batch"], grads["no_sync"], grads["every step"]
    # the same big batch in fp64: how far fp32 rounding alone moves this gradient (the floor the checks scale)
    ddp64 = DDP(copy.deepcopy(ddp.module).double())
    big64, _ = gradient(ddp64, None, images.double(), labels, 1, False)
    big_comm, no_sync_comm, every_comm = comm["big batch"], comm["no_sync"], comm["every step"]

    scale = big.abs().max().item()
    rep.result(micro_batches=n, micro_batch=b, world_size=world_size, global_batch=n * b * world_size,
               params=big.numel(), grad_max_abs=scale,
               no_sync_max_abs_diff=(no_sync - big).abs().max().item(),
               every_step_max_abs_diff=(every - big).abs().max().item(),
               fp32_floor=(big.double() - big64).abs().max().item(),
               repeats=max(1, args.repeats), comm=comm)
    log0(f"{n} micro batches of {b} vs one batch of {n * b} per rank, {world_size} ranks: max |grad difference| "
         f"{(no_sync - big).abs().max().item():.2e} (largest gradient {scale:.2e}); all-reduce calls "
         f"big batch {big_comm['calls']}, no_sync {no_sync_comm['calls']}, every step {every_comm['calls']}")
    del ddp, ddp64
    gc.collect()  # free DDP (and the Python comm hook its reducer holds) while the interpreter is fully alive
    dist.destroy_process_group()


if __name__ == "__main__":
    end_rank(main())  # exits without interpreter teardown: see helpers/rank/runtime.py
