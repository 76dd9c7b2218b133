"""Train SimpleCNN on CIFAR-10 with DeepSpeed (ZeRO stages 0-3), one process per rank.

Run it from the repository root, in a terminal (after `pip install -e .`, which `make setup` does; on a machine
without GPUs put DS_ACCELERATOR=cpu in front):

    deepspeed --num_gpus 2 course/ds_cifar10.py --stage 2 --epochs 1 --train-size 4000
    deepspeed --num_gpus 2 course/ds_cifar10.py --deepspeed_config my_config.json --dtype bf16

This is course/ddp_cifar10.py with the DeepSpeed engine in place of DDP + optimizer: deepspeed.initialize builds
the optimizer and LR schedule from the ds_config (--deepspeed_config, else one built from the flags), and
engine.backward / engine.step average or partition gradients, clip, step and zero them. --stage and --dtype
override the config, as in DeepSpeedExamples/training/cifar; --model memory trains a wide MLP of --params.
"""
import argparse
import itertools
import math
import os
import sys
import time

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

from helpers.calc import dsconfig
from helpers.rank.data import get_datasets
from helpers.rank.metrics import Reporter
from helpers.rank.models import SimpleCNN, count_parameters, make_memory_model
from helpers.rank.runtime import end_rank, forget_deepspeed_shm_buffer, launched_ranks, log0
from helpers.rank.state import model_state_bytes, peak_memory

NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def parse_args():
    p = argparse.ArgumentParser(description="DeepSpeed training of SimpleCNN on CIFAR-10 (launch with deepspeed).")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32, help="micro batch per rank (without --deepspeed_config)")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate (without --deepspeed_config)")
    p.add_argument("--train-size", type=int, default=None, help="use a subset of the training images")
    p.add_argument("--test-size", type=int, default=None, help="use a subset of the test images")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dataset", choices=["auto", "cifar10", "synthetic"], default="auto")
    p.add_argument("--data-root", default="data")
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes per rank")
    p.add_argument("--stage", type=int, choices=[0, 1, 2, 3], default=None, help="ZeRO stage (overrides the config)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None, help="precision (overrides the config)")
    p.add_argument("--model", choices=["cnn", "memory"], default="cnn", help="memory: a wide MLP of --params")
    p.add_argument("--params", type=int, default=20_000_000, help="parameters of --model memory")
    p.add_argument("--depth", type=int, default=4, help="layers of --model memory")
    p.add_argument("--steps", type=int, default=None, help="stop after this many optimizer steps (instead of epochs)")
    p.add_argument("--save-dir", default=None, help="save a DeepSpeed checkpoint here at the end")
    p.add_argument("--load-dir", default=None, help="resume from the latest DeepSpeed checkpoint in this folder")
    p.add_argument("--local_rank", type=int, default=-1, help="passed by the deepspeed launcher (LOCAL_RANK is used)")
    return deepspeed.add_config_arguments(p).parse_args()  # adds --deepspeed_config


@torch.no_grad()
def evaluate(model, test_ds, rank, world_size, device, batch_size, dtype):
    """Test accuracy over the whole test set, with the work split between ranks.

    Each rank scores every WORLD_SIZE-th image starting at its rank, then all_reduce adds up the counts.
    (A DistributedSampler would pad the shards to equal length by repeating images, counting some twice.)
    Under ZeRO-3 every forward all-gathers the partitioned parameters, a collective, so all ranks must run
    the same number of forwards: a rank with one batch fewer runs one extra, uncounted.
    """
    model.eval()
    shard = Subset(test_ds, range(rank, len(test_ds), world_size))
    loader = DataLoader(shard, batch_size=batch_size)
    counts = torch.zeros(2, dtype=torch.long, device=device)  # [correct, seen]
    for images, labels in loader:
        images, labels = images.to(device, dtype), labels.to(device)
        counts[0] += (model(images).argmax(dim=1) == labels).sum()
        counts[1] += labels.numel()
    for _ in range(math.ceil(math.ceil(len(test_ds) / world_size) / batch_size) - len(loader)):
        model(images[:1])
    dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    model.train()
    return counts[0].item() / counts[1].item()


@record  # on a crash under torchrun, the error file names the rank and holds its traceback
def main():
    args = parse_args()
    rank, local_rank, world_size = launched_ranks("deepspeed --num_gpus 2 course/ds_cifar10.py")
    accel = get_accelerator()  # DeepSpeed's device abstraction: CUDA, or CPU with DS_ACCELERATOR=cpu, or ...
    accel.set_device(local_rank)  # before init: NCCL binds each rank to its own GPU (a no-op on the CPU)
    device, backend = torch.device(accel.device_name(local_rank)), accel.communication_backend_name()
    deepspeed.init_distributed(dist_backend=backend)  # torch.distributed underneath, same rendezvous variables
    forget_deepspeed_shm_buffer(rank)  # DeepSpeed's CPU comm buffers would stay in RAM
    try:
        train(args, rank, world_size, device)
    finally:
        dist.destroy_process_group()


def train(args, rank, world_size, device):
    rep = Reporter()  # every rank writes its own records to $HELPERS_RUN_DIR/metrics.jsonl (no-op if unset)
    torch.manual_seed(args.seed)  # same initial weights on every rank (DeepSpeed also broadcasts rank 0's)

    # Rank 0 finds or downloads the data while the others wait (see helpers/rank/data.py): many ranks
    # downloading into one folder at once would corrupt it, and all ranks must agree on which data it is.
    train_ds, test_ds, info = get_datasets(args.dataset, args.data_root, args.train_size, args.test_size, args.seed)
    log0(info.announcement)  # log0: one voice in the terminal, not WORLD_SIZE

    model = SimpleCNN(info.num_classes) if args.model == "cnn" else make_memory_model(args.params, args.depth)
    params = count_parameters(model)  # before ZeRO-3 partitions them away
    config = dsconfig.load(args.deepspeed_config) if args.deepspeed_config else dsconfig.build(
        micro_batch=args.batch_size, lr=args.lr, world_size=world_size)
    config = dsconfig.override(config, stage=args.stage, dtype=args.dtype)  # the flags win over the file
    dsconfig.check(config, world_size)  # a readable "what to change" instead of an assertion inside every rank
    args.deepspeed_config = None  # DeepSpeed gets the dict with our overrides, not the file again
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters(), config=config)
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.half if engine.fp16_enabled() else torch.float32
    if args.load_dir:  # ALL ranks load: each reads its own shard of optimizer state (stage 3: of weights too)
        path, _ = engine.load_checkpoint(args.load_dir)
        if path is None:  # DeepSpeed only warns, and training would silently start from scratch
            sys.exit(f"no DeepSpeed checkpoint (no 'latest' file) in {args.load_dir}")
        log0(f"resumed from {path} at optimizer step {engine.global_steps}")

    # Each rank sees a different 1/WORLD_SIZE of the shuffled data; drop_last keeps the shards equal-sized.
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=engine.train_micro_batch_size_per_gpu(), sampler=sampler,
                        num_workers=args.num_workers)
    # A step here is one micro batch; DeepSpeed steps the optimizer every gradient_accumulation_steps of them.
    total_steps = args.epochs * len(loader) if args.steps is None else args.steps * engine.gradient_accumulation_steps()
    rep.total(total_steps)
    log0(f"world_size={world_size} backend={dist.get_backend()} device={device.type} dtype={NAMES[dtype]} "
         f"zero_stage={engine.zero_optimization_stage()} params={params} global_batch={engine.train_batch_size()} "
         f"steps={total_steps}")

    first, step, samples, model_states, start = engine.global_steps, 0, 0, None, time.perf_counter()
    for epoch in range(math.ceil(total_steps / len(loader))):
        sampler.set_epoch(epoch)  # a different shuffle each epoch, identical on all ranks
        for images, labels in itertools.islice(loader, total_steps - step):
            images, labels = images.to(device, dtype), labels.to(device)
            loss = F.cross_entropy(engine(images), labels)
            engine.backward(loss)  # averages gradients across ranks (ZeRO 2/3: each rank keeps its partition)
            if model_states is None and engine.global_steps == first + 1:  # gradients live, Adam state exists
                model_states = model_state_bytes(engine.module, engine.optimizer)  # this rank's share
            lr = engine.get_lr()[0]  # the rate this step uses; the LR schedule moves on inside engine.step()
            engine.step()  # every gradient_accumulation_steps: clip, optimizer and LR step, zero the gradients
            step += 1
            samples += labels.size(0)
            norm = engine.get_global_grad_norm()  # None until the first optimizer step
            rep.step(step, loss=loss.item(), lr=lr, optimizer_step=engine.global_steps, epoch=epoch,
                     samples=labels.size(0), **({} if norm is None else {"grad_norm": float(norm)}))
            if step % 20 == 0 or step == total_steps:
                log0(f"epoch {epoch} step {step}/{total_steps} loss {loss.item():.4f}")
    train_seconds = time.perf_counter() - start

    accuracy = evaluate(engine, test_ds, rank, world_size, device, batch_size=256, dtype=dtype)
    checkpoint = None
    if args.save_dir:  # ALL ranks call it: under ZeRO each rank holds a shard of the state no other rank has
        engine.save_checkpoint(args.save_dir)
        checkpoint = os.path.join(args.save_dir, f"global_step{engine.global_steps}")

    memory = peak_memory(device)  # this rank's high-water marks, RSS (and CUDA); rank 0's are reported
    log0(f"test accuracy {accuracy:.4f} on {len(test_ds)} images | {train_seconds:.1f} s training")
    rep.result(model_state_bytes=model_states)  # every rank: what it held, for measured-vs-formula per rank
    if rank == 0:
        rep.result(test_accuracy=accuracy, train_samples=samples * world_size, world_size=world_size,
                   global_batch=engine.train_batch_size(), dataset=info.name, checkpoint=checkpoint,
                   zero_stage=engine.zero_optimization_stage(), dtype=NAMES[dtype],
                   params=params, optimizer_steps=engine.global_steps, train_seconds=train_seconds,
                   samples_per_s=samples * world_size / train_seconds, **memory)


if __name__ == "__main__":
    end_rank(main())  # exits without interpreter teardown: see helpers/rank/runtime.py
