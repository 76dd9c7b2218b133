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
import itertools
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from helpers.calc.mesh import shard_size_problem
from helpers.rank import harness
from helpers.rank.devices import rank_device
from helpers.rank.models import count_parameters
from helpers.rank.runtime import end_rank, launched_ranks, log0
from helpers.rank.state import dir_bytes, memory_now, model_state_bytes

# checked by helpers.launch before any rank starts (and by main() below when started from a terminal)
LAUNCH_RULES = {"--shard-size": "divides_world_size"}


def parse_args():
    p = harness.model_flags(harness.dtype_flag(harness.parser("FSDP2 training on CIFAR-10 (launch with torchrun).")))
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


@record  # on a crash, torchrun's error file names the rank and holds its traceback
def main():
    args = parse_args()
    rank, local_rank, world_size = launched_ranks("torchrun --nproc-per-node 2 course/fsdp2_cifar10.py")
    device, backend = rank_device(local_rank)  # GPU LOCAL_RANK + NCCL (set before init), else CPU + gloo
    if args.cpu_offload and device.type != "cuda":  # refused before anything starts, with what to change
        sys.exit("--cpu-offload keeps the shards in CPU memory and copies them to the GPU for every all-gather; "
                 "on a CPU rank they are in CPU memory already (and pinning needs CUDA): drop --cpu-offload")
    if args.bf16 and args.dtype != "fp32":
        sys.exit("--bf16 computes in bf16 from fp32 shards; drop --dtype fp64, or drop --bf16")
    problem = shard_size_problem(world_size, args.shard_size)
    if problem:
        sys.exit(problem)
    args.shard_size = args.shard_size or world_size
    dist.init_process_group(backend)
    try:
        train(args, rank, world_size, device)
    finally:
        dist.destroy_process_group()


def train(args, rank, world_size, device):
    torch.manual_seed(args.seed)  # same initial weights on every rank; each then keeps only its shard
    train_ds, test_ds, info = harness.datasets(args)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.num_workers)
    rss_start = memory_now(device)["rss_mib"]  # before the model exists: the framework's own share

    dtype = harness.train_dtype(args)  # fp32; fp64 only to measure fp32 rounding (helpers/calc/parity.py)
    model = harness.build_model(args, info.num_classes).to(device, dtype)  # SimpleCNN, or --model memory's MLP
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
    for block in [m for m in model.children() if list(m.parameters())]:  # the sharding units: one all-gather each
        fully_shard(block, **shard)
    fully_shard(model, **shard)  # the root: whatever the blocks left over, and the start/end of each step
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)  # built AFTER fully_shard: it sees the shards

    start = 0
    if args.load_dir:  # every rank reads the pieces of every tensor its own shards need: any world size works
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd, "step": torch.tensor(0)}
        dcp.load(state, checkpoint_id=args.load_dir)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = int(state["step"])
        log0(f"resumed from {args.load_dir} at step {start}, now on {world_size} ranks")

    total_steps = args.steps if args.steps is not None else args.epochs * len(loader)
    log0(f"world_size={world_size} backend={dist.get_backend()} device={device.type} mesh={tuple(mesh.mesh.shape)} "
         f"params={params} global_batch={args.batch_size * world_size} steps={total_steps} "
         f"reshard_after_forward={shard['reshard_after_forward']} bf16={args.bf16}")
    meter = harness.Meter(total_steps, device, world_size, samples_per_step=args.batch_size * world_size,
                          skip=args.skip_steps, start=start, memory=True, comm=harness.count_fsdp_comms(model))
    states = None
    for epoch in itertools.count(start // len(loader)):
        if meter.done >= total_steps:
            break
        sampler.set_epoch(epoch)  # the same global batches at any world size with the same global batch
        resume_at = meter.done % len(loader) if epoch == start // len(loader) else 0
        for images, labels in meter.batches(itertools.islice(loader, resume_at, None)):
            images, labels = images.to(device, dtype), labels.to(device)
            loss = F.cross_entropy(model(images), labels)  # each block all-gathers its weights, then frees them
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # gathers again (if resharded), then reduce-scatters: each rank keeps its gradient shard
            optimizer.step()  # Adam on the local shards only: no communication
            states = states or model_state_bytes(model, optimizer)  # sharded gradients and Adam state exist now
            meter.step(loss=loss.item(), epoch=epoch, samples=labels.size(0))
    run = meter.finish()

    accuracy = harness.evaluate(model, test_ds, device, dtype=dtype)  # every forward all-gathers: all ranks join
    checkpoint = checkpoint_bytes = None
    if args.save_dir:  # ALL ranks save: each writes its own shards, rank 0 also the metadata (.metadata)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd, "step": torch.tensor(meter.done)},
                 checkpoint_id=args.save_dir)
        checkpoint, checkpoint_bytes = args.save_dir, dir_bytes(args.save_dir)
        if args.export and rank == 0:  # offline conversion: no process group needed, reads every shard
            dcp_to_torch_save(args.save_dir, args.export)  # {"model": plain state_dict, "optim": ..., "step": ...}
        dist.barrier()  # nobody moves on (or exits) before the checkpoint is on disk

    log0(f"test accuracy {accuracy:.4f} on {len(test_ds)} images | {run['train_seconds']:.1f} s training | "
         f"{meter.throughput_line()}")
    hsdp = args.shard_size < world_size  # HSDP's all-reduce across the replicas goes uncounted: report none
    meter.rep.result(model_state_bytes=states, comm_per_step=None if hsdp else meter.comm_per_step())  # every rank
    meter.report(framework="fsdp2", test_accuracy=accuracy, global_batch=args.batch_size * world_size,
                 dataset=info.name, shard_size=args.shard_size, params=params, steps=meter.done, resumed_from=start,
                 dtype="bf16" if args.bf16 else args.dtype, reshard_after_forward=shard["reshard_after_forward"],
                 checkpoint=checkpoint, checkpoint_bytes=checkpoint_bytes, exported=args.export,
                 rss_start_mib=rss_start)


if __name__ == "__main__":
    end_rank(main())  # exits without interpreter teardown: see helpers/rank/runtime.py
