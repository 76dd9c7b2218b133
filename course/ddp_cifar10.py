"""Train SimpleCNN on CIFAR-10 with DistributedDataParallel (DDP), one process per rank.

Run it from the repository root, in a terminal (after `pip install -e .`, which `make setup` does):

    torchrun --nproc-per-node 2 course/ddp_cifar10.py --epochs 1 --train-size 4000

torchrun starts --nproc-per-node copies of this script and gives each one RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT. With GPUs, each rank drives the GPU numbered LOCAL_RANK and ranks talk over
NCCL; without, they run on the CPU and talk over gloo. Same script either way.

Data: --dataset auto uses CIFAR-10 from --data-root, downloading it if it can, and otherwise generated
CIFAR-shaped images -- rank 0 prints which one, and results on generated data are not CIFAR-10 results.
What every training script repeats (flags, data, step clock and records, evaluation) is in helpers/rank/harness.py;
what is written out here is DDP.
"""
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from helpers.rank import harness
from helpers.rank.checkpoint import save_atomic
from helpers.rank.devices import rank_device
from helpers.rank.models import SimpleCNN
from helpers.rank.runtime import end_rank, launched_ranks, log0


def parse_args():
    p = harness.dtype_flag(harness.parser("DDP training of SimpleCNN on CIFAR-10 (launch with torchrun)."))
    p.add_argument("--out-dir", default=os.environ.get("HELPERS_RUN_DIR") or "runs/ddp_cifar10")
    return p.parse_args()


@record  # on a crash, torchrun's error file names the rank and holds its traceback
def main():
    args = parse_args()
    rank, local_rank, world_size = launched_ranks("torchrun --nproc-per-node 2 course/ddp_cifar10.py")
    device, backend = rank_device(local_rank)  # GPU LOCAL_RANK + NCCL (set before init), else CPU + gloo
    dist.init_process_group(backend)  # rendezvous at MASTER_ADDR:MASTER_PORT, set by torchrun
    try:
        train(args, rank, local_rank, world_size, device)
    finally:
        dist.destroy_process_group()


def train(args, rank, local_rank, world_size, device):
    torch.manual_seed(args.seed)  # same initial weights on every rank (DDP also broadcasts rank 0's at wrap)
    train_ds, test_ds, info = harness.datasets(args)  # rank 0 downloads (or generates) while the others wait

    # Each rank sees a different 1/WORLD_SIZE of the shuffled data; drop_last keeps the shards equal-sized.
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.num_workers)

    dtype = harness.train_dtype(args)  # fp32; fp64 only to measure fp32 rounding (helpers/calc/parity.py)
    model = DDP(SimpleCNN(info.num_classes).to(device, dtype),
                device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    total_steps = args.steps if args.steps is not None else args.epochs * len(loader)
    log0(f"world_size={world_size} backend={dist.get_backend()} device={device.type} "
         f"global_batch={args.batch_size * world_size} steps={total_steps}")
    # the meter numbers the steps (from 1), times each one (batch fetch to finished work), writes the step records
    meter = harness.Meter(total_steps, device, world_size, samples_per_step=args.batch_size * world_size,
                          skip=args.skip_steps)
    for epoch in range(-(-total_steps // len(loader))):
        sampler.set_epoch(epoch)  # a different shuffle each epoch, identical on all ranks
        for images, labels in meter.batches(loader):
            images, labels = images.to(device, dtype), labels.to(device)
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP all-reduces (averages) the gradients across ranks during backward
            optimizer.step()  # identical gradients -> identical updates -> replicas stay in sync
            meter.step(loss=loss.item(), epoch=epoch, samples=labels.size(0))
    run = meter.finish()  # steady-state samples/s from every rank's step times (helpers/calc/throughput.py)

    # .module: no gradients, nothing to synchronise
    accuracy = harness.evaluate(model.module, test_ds, device, dtype=dtype)
    checkpoint = os.path.join(args.out_dir, "ddp_model.pt")
    if rank == 0:  # save_atomic: temporary file, fsync, rename -- a crash never leaves half a checkpoint
        save_atomic(model.module.state_dict(), checkpoint)  # .module: the plain model, no "module." prefix
    dist.barrier()  # nobody moves on (or exits) before the checkpoint is on disk

    log0(f"test accuracy {accuracy:.4f} on {len(test_ds)} images | {run['train_seconds']:.1f} s training | "
         f"{meter.throughput_line()}")
    meter.report(framework="ddp", test_accuracy=accuracy, global_batch=args.batch_size * world_size,
                 dataset=info.name, checkpoint=checkpoint, dtype=args.dtype)


if __name__ == "__main__":
    end_rank(main())  # exits without interpreter teardown: see helpers/rank/runtime.py
