"""DDP training with the knobs of chapter 05, each a flag, and every step measured.

    torchrun --nproc-per-node 2 course/ddp_tuning.py --steps 30 --clip 1.0 --warmup-steps 10
    torchrun --nproc-per-node 2 course/ddp_tuning.py --model memory --params 20000000 --steps 5 --save-dir ckpt

This is course/ddp_cifar10.py counted in optimizer steps instead of epochs, plus: gradient clipping (--clip), linear
LR warmup (--warmup-steps), bf16 autocast (--bf16), gradient accumulation with no_sync() (--accumulation),
torch.compile (--compile), SGD or AdamW (--optimizer), and a wide MLP of --params parameters (--model memory).
Every rank reports per optimizer step: loss, gradient norm (before clipping), learning rate, memory (RSS; on a GPU
also allocated and peak CUDA memory) and step time. Its DeepSpeed twin, course/ds_tuning.py, takes the same flags;
diff the two to see what the DeepSpeed engine and its config take over.
"""
import contextlib
import gc
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
from helpers.rank.models import count_parameters
from helpers.rank.runtime import end_rank, launched_ranks, log0
from helpers.rank.state import dir_bytes, memory_now, model_state_bytes


def parse_args():
    # the flags both twins share come from helpers/rank/harness.py; only what differs is added here
    p = harness.tuning_flags(harness.parser("DDP training with clipping, warmup, bf16, accumulation, compile.",
                                            steps=20, test_size=100))
    harness.dtype_flag(p)  # fp64: only to measure the noise floor of fp32 rounding (helpers/calc/parity.py)
    p.add_argument("--compile", action="store_true", help="torch.compile the DDP model")
    p.add_argument("--no-count-comms", action="store_true",
                   help="leave out the counting comm hook (DDP's built-in all-reduce): for timing runs that compare "
                        "like with like against uncounted DeepSpeed runs")
    args = p.parse_args()
    if args.bf16 and args.dtype != "fp32":
        p.error("--bf16 autocasts an fp32 model; it does not combine with --dtype fp64")
    return args


@record
def main():
    args = parse_args()
    rank, local_rank, world_size = launched_ranks("torchrun --nproc-per-node 2 course/ddp_tuning.py")
    device, backend = rank_device(local_rank)
    dist.init_process_group(backend)
    try:
        train(args, rank, local_rank, world_size, device)
    finally:
        gc.collect()  # free DDP (and the Python comm hook its reducer holds) while the interpreter is fully alive
        dist.destroy_process_group()


def train(args, rank, local_rank, world_size, device):
    torch.manual_seed(args.seed)
    train_ds, _, info = harness.datasets(args)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    data = harness.batches(DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler), sampler)  # set_epoch
    rss_start = memory_now(device)["rss_mib"]  # before the model exists: the framework's own share

    dtype = harness.train_dtype(args)
    model = harness.build_model(args, info.num_classes).to(dtype)
    params = count_parameters(model)
    # gradient_as_bucket_view: the gradients live inside DDP's all-reduce buckets, one copy instead of two
    ddp = DDP(model.to(device), device_ids=[local_rank] if device.type == "cuda" else None,
              gradient_as_bucket_view=True)
    comm = None if args.no_count_comms else harness.count_ddp_comms(ddp)  # a comm hook: counts, then all-reduces
    net = torch.compile(ddp) if args.compile else ddp  # compiles on the first forward (the first step is slow)
    if args.optimizer == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    # linear warmup from 0 to --lr over --warmup-steps optimizer steps, then constant (DeepSpeed: WarmupLR)
    warmup = lambda s: min(1.0, s / args.warmup_steps) if args.warmup_steps else 1.0
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)

    global_batch = args.batch_size * args.accumulation * world_size
    log0(f"world_size={world_size} backend={dist.get_backend()} device={device.type} params={params} "
         f"global_batch={global_batch} steps={args.steps}")
    meter = harness.Meter(args.steps, device, world_size, samples_per_step=global_batch, skip=args.skip_steps,
                          memory=True, comm=comm, log_every=10)
    states = None
    for _ in meter.steps():
        optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for micro in range(args.accumulation):
            images, labels = next(data)
            images, labels = images.to(device, dtype), labels.to(device)
            # no_sync(): on all but the last micro batch, skip the all-reduce and let gradients add up locally;
            # the last backward all-reduces the sum once per optimizer step
            last = micro == args.accumulation - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
                    loss = F.cross_entropy(net(images), labels) / args.accumulation  # mean over the global batch
                loss.backward()
            loss_sum += loss.item()
        lr = scheduler.get_last_lr()[0]
        # returns the norm BEFORE clipping; without --clip an infinite max norm only measures it
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip or float("inf"))
        optimizer.step()
        scheduler.step()
        states = states or model_state_bytes(model, optimizer)  # gradients and optimizer state both exist now
        meter.step(loss=loss_sum, grad_norm=float(grad_norm), lr=lr, samples=args.batch_size * args.accumulation)
    meter.finish()

    checkpoint_bytes = None
    if args.save_dir:
        if rank == 0:  # every rank holds the same full state: one copy is the whole checkpoint
            path = os.path.join(args.save_dir, "ddp_checkpoint.pt")  # written atomically, fsynced
            save_atomic({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
            checkpoint_bytes = dir_bytes(args.save_dir)
        dist.barrier()
    meter.rep.result(model_state_bytes=states, comm_per_step=meter.comm_per_step())  # every rank: its own
    meter.report(framework="ddp", dtype="bf16-autocast" if args.bf16 else args.dtype, params=params,
                 global_batch=global_batch, rss_start_mib=rss_start, checkpoint_bytes=checkpoint_bytes,
                 compiled=args.compile)


if __name__ == "__main__":
    end_rank(main())  # exits without interpreter teardown: see helpers/rank/runtime.py
