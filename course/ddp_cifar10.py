"""Train SimpleCNN on CIFAR-10 with DistributedDataParallel (DDP), one process per rank.

Run it from the repository root, in a terminal (after `pip install -e .`, which `make setup` does):

    torchrun --nproc-per-node 2 course/ddp_cifar10.py --epochs 1 --train-size 4000

torchrun starts --nproc-per-node copies of this script and gives each one RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT. With GPUs, each rank drives the GPU numbered LOCAL_RANK and ranks talk over
NCCL; without, they run on the CPU and talk over gloo. Same script either way.

Data: --dataset auto uses CIFAR-10 from --data-root, downloading it if it can, and otherwise generated
CIFAR-shaped images -- rank 0 prints which one, and results on generated data are not CIFAR-10 results.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

from helpers.rank.checkpoint import save_atomic
from helpers.rank.data import get_datasets
from helpers.rank.devices import rank_device
from helpers.rank.metrics import Reporter
from helpers.rank.models import SimpleCNN
from helpers.rank.runtime import end_rank, launched_ranks, log0
from helpers.rank.state import peak_memory


def parse_args():
    p = argparse.ArgumentParser(description="DDP training of SimpleCNN on CIFAR-10 (launch with torchrun).")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32, help="per rank; the global batch is this x WORLD_SIZE")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--train-size", type=int, default=None, help="use a subset of the training images")
    p.add_argument("--test-size", type=int, default=None, help="use a subset of the test images")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dataset", choices=["auto", "cifar10", "synthetic"], default="auto")
    p.add_argument("--data-root", default="data")
    p.add_argument("--out-dir", default=os.environ.get("HELPERS_RUN_DIR") or "runs/ddp_cifar10")
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes per rank")
    p.add_argument("--skip-steps", type=int, default=5,
                   help="steps left out of samples_per_s: allocator warm-up, DDP's first bucketing, first all-reduce")
    return p.parse_args()


@torch.no_grad()
def evaluate(model, test_ds, rank, world_size, device, batch_size):
    """Test accuracy over the whole test set, with the work split between ranks.

    Each rank scores every WORLD_SIZE-th image starting at its rank, then all_reduce adds up the counts.
    (A DistributedSampler would pad the shards to equal length by repeating images, counting some twice.)
    We call the plain module, not the DDP wrapper: no gradients here, so there is nothing to synchronise.
    """
    model.eval()
    shard = Subset(test_ds, range(rank, len(test_ds), world_size))
    counts = torch.zeros(2, dtype=torch.long, device=device)  # [correct, seen]
    for images, labels in DataLoader(shard, batch_size=batch_size):
        images, labels = images.to(device), labels.to(device)
        counts[0] += (model(images).argmax(dim=1) == labels).sum()
        counts[1] += labels.numel()
    dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    model.train()
    return counts[0].item() / counts[1].item()


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
    rep = Reporter()  # every rank writes its own records to $HELPERS_RUN_DIR/metrics.jsonl (no-op if unset)
    torch.manual_seed(args.seed)  # same initial weights on every rank (DDP also broadcasts rank 0's at wrap)

    # Rank 0 finds or downloads the data while the others wait (see helpers/rank/data.py): many ranks
    # downloading into one folder at once would corrupt it, and all ranks must agree on which data it is.
    train_ds, test_ds, info = get_datasets(args.dataset, args.data_root, args.train_size, args.test_size, args.seed)
    log0(info.announcement)  # log0: one voice in the terminal, not WORLD_SIZE

    # Each rank sees a different 1/WORLD_SIZE of the shuffled data; drop_last keeps the shards equal-sized.
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.num_workers)

    model = DDP(SimpleCNN(info.num_classes).to(device), device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    total_steps = args.epochs * len(loader)
    rep.total(total_steps)
    log0(f"world_size={world_size} backend={dist.get_backend()} device={device.type} "
         f"global_batch={args.batch_size * world_size} steps={total_steps}")

    # Throughput is the steady state: the first --skip-steps steps (allocator warm-up, DDP's first bucketing and
    # all-reduce, lazy initialisation) are left out of samples_per_s, and only steps skip+1 .. last are timed
    # (data loading, forward, backward with its all-reduce, optimizer step), on rank 0. first_step_s shows the
    # start-up cost that is skipped. On GPUs each step ends with a synchronize, so the clock sees finished work.
    skip = max(0, min(args.skip_steps, total_steps - 1))
    step, samples, timed_samples, timed_s, first_step_s = 0, 0, 0, 0.0, None
    start = time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a different shuffle each epoch, identical on all ranks
        step_start = time.perf_counter()
        for images, labels in loader:
            images, labels = images.to(device), labels.to(device)
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP all-reduces (averages) the gradients across ranks during backward
            optimizer.step()  # identical gradients -> identical updates -> replicas stay in sync
            loss_value = loss.item()
            if device.type == "cuda":
                torch.cuda.synchronize()
            step_s = time.perf_counter() - step_start
            step += 1
            samples += labels.size(0)
            first_step_s = step_s if first_step_s is None else first_step_s
            if step > skip:
                timed_samples, timed_s = timed_samples + labels.size(0), timed_s + step_s
            rep.step(step, loss=loss_value, epoch=epoch, samples=labels.size(0), step_s=step_s)
            if step % 20 == 0 or step == total_steps:
                log0(f"epoch {epoch} step {step}/{total_steps} loss {loss_value:.4f}")
            step_start = time.perf_counter()  # the next step's clock includes fetching its batch
    train_seconds = time.perf_counter() - start
    samples_per_s = timed_samples * world_size / timed_s if timed_s else None

    accuracy = evaluate(model.module, test_ds, rank, world_size, device, batch_size=256)
    checkpoint = os.path.join(args.out_dir, "ddp_model.pt")
    if rank == 0:  # save_atomic: temporary file, fsync, rename -- a crash never leaves half a checkpoint
        save_atomic(model.module.state_dict(), checkpoint)  # .module: the plain model, no "module." prefix
    dist.barrier()  # nobody moves on (or exits) before the checkpoint is on disk

    memory = peak_memory(device)  # this rank's high-water marks, RSS (and CUDA); rank 0's are reported
    rate = f"{samples_per_s:.0f} samples/s over steps {skip + 1}-{total_steps}" if samples_per_s else "no steps"
    log0(f"test accuracy {accuracy:.4f} on {len(test_ds)} images | {train_seconds:.1f} s training | {rate}")
    if rank == 0:
        rep.result(test_accuracy=accuracy, train_samples=samples * world_size, world_size=world_size,
                   global_batch=args.batch_size * world_size, dataset=info.name, checkpoint=checkpoint,
                   train_seconds=train_seconds, first_step_s=first_step_s,
                   samples_per_s=samples_per_s, **memory)


if __name__ == "__main__":
    end_rank(main())  # exits without interpreter teardown: see helpers/rank/runtime.py
