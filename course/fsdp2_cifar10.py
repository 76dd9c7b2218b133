"""Train SimpleCNN on CIFAR-10 with PyTorch's FSDP2 (fully_shard), one process per rank.

Run it from any directory, in a terminal (after `pip install -e .`, which `make setup` does):

    torchrun --nproc-per-node 2 course/fsdp2_cifar10.py --epochs 1 --train-size 4000 --save-dir runs/fsdp2/ckpt
    torchrun --nproc-per-node 3 course/fsdp2_cifar10.py --batch-size 16 --load-dir runs/fsdp2/ckpt  # resharded

This is course/ddp_cifar10.py with DDP replaced by FSDP2: a device mesh over the ranks, fully_shard on every block
and then on the root, so each rank keeps 1/WORLD_SIZE of every parameter, gradient and Adam state (a DTensor
shard, like ZeRO-3). Forward and backward all-gather a block's parameters just before it runs; backward
reduce-scatters its gradients. Checkpoints are torch.distributed.checkpoint (DCP): one shard file per rank, loadable
at any world size; --export converts one into a plain state_dict file (the counterpart of DeepSpeed's zero_to_fp32).
"""
import argparse
import itertools
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

from helpers.calc.mesh import shard_size_problem
from helpers.rank.data import get_datasets
from helpers.rank.devices import rank_device
from helpers.rank.metrics import Reporter
from helpers.rank.models import SimpleCNN, count_parameters
from helpers.rank.runtime import end_rank, launched_ranks, log0
from helpers.rank.state import dir_bytes, memory_now, model_state_bytes, peak_memory


def parse_args():
    p = argparse.ArgumentParser(description="FSDP2 training of SimpleCNN on CIFAR-10 (launch with torchrun).")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--steps", type=int, default=None, help="stop after this many steps in all (instead of epochs)")
    p.add_argument("--batch-size", type=int, default=32, help="per rank; the global batch is this x WORLD_SIZE")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--train-size", type=int, default=None, help="use a subset of the training images")
    p.add_argument("--test-size", type=int, default=None, help="use a subset of the test images")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dataset", choices=["auto", "cifar10", "synthetic"], default="auto")
    p.add_argument("--data-root", default="data")
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes per rank")
    p.add_argument("--skip-steps", type=int, default=5, help="steps left out of samples_per_s (warm-up)")
    p.add_argument("--no-reshard-after-forward", action="store_true",
                   help="keep gathered parameters from forward to backward (ZeRO-2-like: more memory, fewer gathers)")
    p.add_argument("--bf16", action="store_true", help="MixedPrecisionPolicy: bf16 compute, fp32 gradient reduction")
    p.add_argument("--cpu-offload", action="store_true", help="CPUOffloadPolicy: shards live in (pinned) CPU memory")
    p.add_argument("--shard-size", type=int, default=None,
                   help="ranks one copy is sharded over (default: all); fewer -> HSDP, replicated across the groups")
    p.add_argument("--save-dir", default=None, help="save a DCP checkpoint (one shard per rank) here at the end")
    p.add_argument("--load-dir", default=None, help="resume from this DCP checkpoint, at any world size")
    p.add_argument("--export", default=None, help="also write the checkpoint as one plain state_dict file here")
    return p.parse_args()


class CountingAllGather(DefaultAllGather):
    """FSDP2's own all-gather, counting the calls and the bytes of this rank's shard (what it hands over)."""

    def __init__(self, counter):
        self.counter = counter

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.counter["calls"] += 1
        self.counter["bytes"] += input_tensor.numel() * input_tensor.element_size()
        return super().__call__(output_tensor, input_tensor, group, async_op)


class CountingReduceScatter(DefaultReduceScatter):
    """FSDP2's own reduce-scatter, counting the calls and the bytes of the whole input (every rank's gradients)."""

    def __init__(self, counter):
        self.counter = counter

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.counter["calls"] += 1
        self.counter["bytes"] += input_tensor.numel() * input_tensor.element_size()
        return super().__call__(output_tensor, input_tensor, group, op, async_op)


@torch.no_grad()
def evaluate(model, test_ds, rank, world_size, device, batch_size):
    """Test accuracy over the whole test set, with the work split between ranks.

    Every forward all-gathers the sharded parameters, a collective, so all ranks must run the same number of
    forwards: a rank with one batch fewer runs one extra, uncounted (as under DeepSpeed ZeRO-3).
    """
    model.eval()
    shard = Subset(test_ds, range(rank, len(test_ds), world_size))
    loader = DataLoader(shard, batch_size=batch_size)
    counts = torch.zeros(2, dtype=torch.long, device=device)  # [correct, seen]
    for images, labels in loader:
        images, labels = images.to(device), labels.to(device)
        counts[0] += (model(images).argmax(dim=1) == labels).sum()
        counts[1] += labels.numel()
    for _ in range(math.ceil(math.ceil(len(test_ds) / world_size) / batch_size) - len(loader)):
        model(images[:1])
    dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    model.train()
    return counts[0].item() / counts[1].item()


@record  # on a crash, torchrun's error file names the rank and holds its traceback
def main():
    args = parse_args()
    rank, local_rank, world_size = launched_ranks("torchrun --nproc-per-node 2 course/fsdp2_cifar10.py")
    device, backend = rank_device(local_rank)  # GPU LOCAL_RANK + NCCL (set before init), else CPU + gloo
    if args.cpu_offload and device.type != "cuda":  # refused before anything starts, with what to change
        sys.exit("--cpu-offload keeps the shards in CPU memory and copies them to the GPU for every all-gather; "
                 "on a CPU rank they are in CPU memory already (and pinning needs CUDA): drop --cpu-offload")
    problem = shard_size_problem(world_size, args.shard_size)  # helpers.launch checks the same before launching
    if problem:
        sys.exit(problem)
    args.shard_size = args.shard_size or world_size
    dist.init_process_group(backend)
    try:
        train(args, rank, world_size, device)
    finally:
        dist.destroy_process_group()


def train(args, rank, world_size, device):
    rep = Reporter()
    torch.manual_seed(args.seed)  # same initial weights on every rank; each then keeps only its shard
    train_ds, test_ds, info = get_datasets(args.dataset, args.data_root, args.train_size, args.test_size, args.seed)
    log0(info.announcement)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.num_workers)
    rss_start = memory_now(device)["rss_mib"]  # before the model exists: the framework's own share

    model = SimpleCNN(info.num_classes).to(device)
    params = count_parameters(model)  # before sharding
    if args.shard_size == world_size:  # 1-D mesh: shard over every rank ("cpu" or "cuda")
        mesh = init_device_mesh(device.type, (world_size,))
    else:  # 2-D: shard within groups of --shard-size ranks, replicate (all-reduce gradients) across the groups
        mesh = init_device_mesh(device.type, (world_size // args.shard_size, args.shard_size),
                                mesh_dim_names=("replicate", "shard"))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 \
        else MixedPrecisionPolicy()  # default: compute and reduce in the parameters' own dtype (fp32)
    shard = dict(mesh=mesh, reshard_after_forward=not args.no_reshard_after_forward, mp_policy=mp,
                 offload_policy=CPUOffloadPolicy() if args.cpu_offload else OffloadPolicy())
    for block in (model.conv1, model.conv2, model.fc1, model.fc2):  # the sharding units: one all-gather each
        fully_shard(block, **shard)
    fully_shard(model, **shard)  # the root: whatever the blocks left over, and the start/end of each step
    comm = {"all_gather_into_tensor": {"calls": 0, "bytes": 0}, "reduce_scatter_tensor": {"calls": 0, "bytes": 0}}
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_custom_all_gather(CountingAllGather(comm["all_gather_into_tensor"]))
            m.set_custom_reduce_scatter(CountingReduceScatter(comm["reduce_scatter_tensor"]))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)  # built AFTER fully_shard: it sees the shards

    start_step = 0
    if args.load_dir:  # every rank reads the pieces of every tensor its own shards need: any world size works
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd, "step": torch.tensor(0)}
        dcp.load(state, checkpoint_id=args.load_dir)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start_step = int(state["step"])
        log0(f"resumed from {args.load_dir} at step {start_step}, now on {world_size} ranks")

    total_steps = args.epochs * len(loader) if args.steps is None else args.steps
    rep.total(total_steps - start_step)
    log0(f"world_size={world_size} backend={dist.get_backend()} device={device.type} mesh={tuple(mesh.mesh.shape)} "
         f"params={params} global_batch={args.batch_size * world_size} steps={total_steps} "
         f"reshard_after_forward={shard['reshard_after_forward']} bf16={args.bf16}")
    skip = max(0, min(args.skip_steps, total_steps - start_step - 1))
    step, samples, timed_samples, timed_s, first_step_s, states = start_step, 0, 0, 0.0, None, None
    start = time.perf_counter()
    for epoch in itertools.count(start_step // len(loader)):
        if step >= total_steps:
            break
        sampler.set_epoch(epoch)  # the same global batches at any world size with the same global batch
        batches = itertools.islice(loader, step % len(loader) if epoch == start_step // len(loader) else 0, None)
        step_start = time.perf_counter()
        for images, labels in itertools.islice(batches, total_steps - step):
            images, labels = images.to(device), labels.to(device)
            loss = F.cross_entropy(model(images), labels)  # each block all-gathers its weights, then frees them
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # gathers again (if resharded), then reduce-scatters: each rank keeps its gradient shard
            optimizer.step()  # Adam on the local shards only: no communication
            if states is None:  # sharded gradients and Adam state both exist now
                states = model_state_bytes(model, optimizer)
            loss_value = loss.item()
            if device.type == "cuda":
                torch.cuda.synchronize()
            step_s = time.perf_counter() - step_start
            step += 1
            samples += labels.size(0)
            first_step_s = step_s if first_step_s is None else first_step_s
            if step == start_step + 1:  # count the steps after the first, like the timing
                for counter in comm.values():
                    counter.update(calls=0, bytes=0)
            if step > start_step + skip:
                timed_samples, timed_s = timed_samples + labels.size(0), timed_s + step_s
            rep.step(step, loss=loss_value, epoch=epoch, samples=labels.size(0), step_s=step_s, **memory_now(device))
            if step % 20 == 0 or step == total_steps:
                log0(f"epoch {epoch} step {step}/{total_steps} loss {loss_value:.4f}")
            step_start = time.perf_counter()
    train_seconds = time.perf_counter() - start
    samples_per_s = timed_samples * world_size / timed_s if timed_s else None
    per_step = {op: {k: v / max(1, step - start_step - 1) for k, v in c.items()} for op, c in comm.items()}

    accuracy = evaluate(model, test_ds, rank, world_size, device, batch_size=256)
    checkpoint = checkpoint_bytes = None
    if args.save_dir:  # ALL ranks save: each writes its own shards, rank 0 also the metadata (.metadata)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd, "step": torch.tensor(step)}, checkpoint_id=args.save_dir)
        checkpoint, checkpoint_bytes = args.save_dir, dir_bytes(args.save_dir)
        if args.export and rank == 0:  # offline conversion: no process group needed, reads every shard
            dcp_to_torch_save(args.save_dir, args.export)  # {"model": plain state_dict, "optim": ..., "step": ...}
        dist.barrier()  # nobody moves on (or exits) before the checkpoint is on disk

    memory = peak_memory(device)
    rate = f"{samples_per_s:.0f} samples/s over steps {start_step + skip + 1}-{step}" if samples_per_s else "no steps"
    log0(f"test accuracy {accuracy:.4f} on {len(test_ds)} images | {train_seconds:.1f} s training | {rate}")
    hsdp = args.shard_size < world_size  # HSDP's all-reduce across the replicas goes uncounted: report none
    rep.result(model_state_bytes=states, comm_per_step=None if hsdp else per_step)  # every rank: its own
    if rank == 0:
        rep.result(framework="fsdp2", test_accuracy=accuracy, train_samples=samples * world_size,
                   world_size=world_size, global_batch=args.batch_size * world_size, dataset=info.name,
                   shard_size=args.shard_size,
                   params=params, dtype="bf16" if args.bf16 else "fp32", steps=step, resumed_from=start_step,
                   reshard_after_forward=shard["reshard_after_forward"], checkpoint=checkpoint,
                   checkpoint_bytes=checkpoint_bytes, exported=args.export, rss_start_mib=rss_start,
                   train_seconds=train_seconds, first_step_s=first_step_s, samples_per_s=samples_per_s, **memory)


if __name__ == "__main__":
    end_rank(main())  # exits without interpreter teardown: see helpers/rank/runtime.py
