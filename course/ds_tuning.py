"""course/ddp_tuning.py with the DeepSpeed engine in place of DDP + optimizer + clipping + scheduler + autocast.

    deepspeed --num_gpus 2 course/ds_tuning.py --stage 2 --steps 30 --clip 1.0 --warmup-steps 10
    deepspeed --num_gpus 2 course/ds_tuning.py --model memory --params 20000000 --stage 3 --offload both --steps 5

(On a machine without GPUs put DS_ACCELERATOR=cpu in front.) The same flags as the DDP script, turned into a
ds_config by helpers.calc.dsconfig.build (helpers.rank.deepspeed_facts.build_config): --clip is gradient_clipping,
--warmup-steps a WarmupLR scheduler, --bf16 the bf16 section (weights and gradients in bf16, fp32 master copy in the
optimizer), --accumulation gradient_accumulation_steps; --stage and --offload pick ZeRO's partitioning. Every rank reports the same per-step
fields as the DDP script, plus the model-state bytes it holds, read from the engine.
"""
import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from helpers.rank import harness
from helpers.rank.deepspeed_facts import build_config
from helpers.rank.models import count_parameters
from helpers.rank.runtime import end_rank, forget_deepspeed_shm_buffer, launched_ranks, log0
from helpers.rank.state import dir_bytes, memory_now, model_state_bytes


def parse_args():
    # the flags both twins share come from helpers/rank/harness.py; only what differs is added here
    p = harness.tuning_flags(harness.parser("DeepSpeed twin of course/ddp_tuning.py (launch with deepspeed).",
                                            steps=20, test_size=100))
    p.add_argument("--stage", type=int, choices=[0, 1, 2, 3], default=0, help="ZeRO stage")
    p.add_argument("--offload", choices=["optimizer", "param", "both"], default=None, help="ZeRO offload to CPU")
    p.add_argument("--bucket-size", type=int, default=None, help="ZeRO reduce/allgather bucket, in elements")
    p.add_argument("--sub-group-size", type=int, default=None,
                   help="ZeRO-3 optimizer step in tiles of this many elements (default 1e9: the whole partition at once)")
    p.add_argument("--count-comms", action="store_true",
                   help="DeepSpeed's comms_logger counts every collective (synchronises after each: slower on GPUs)")
    p.add_argument("--local_rank", type=int, default=-1, help="passed by the deepspeed launcher (LOCAL_RANK is used)")
    return p.parse_args()


def ds_config(args, world_size):
    """The flags as a ds_config, checked (batch rule, dtype on this device, offload vs stage) before DeepSpeed."""
    zero = {}
    if args.bucket_size:  # the defaults (5e8 elements) are sized for big GPUs
        zero = {"reduce_bucket_size": args.bucket_size, "allgather_bucket_size": args.bucket_size,
                "stage3_prefetch_bucket_size": args.bucket_size}
    if args.sub_group_size:  # the step flattens and updates one tile at a time: its temporaries are a tile's
        zero["sub_group_size"] = args.sub_group_size
    config = build_config(stage=args.stage, dtype="bf16" if args.bf16 else "fp32", micro_batch=args.batch_size,
                            accumulation=args.accumulation, world_size=world_size, lr=args.lr,
                            optimizer="SGD" if args.optimizer == "sgd" else "AdamW", warmup_steps=args.warmup_steps,
                            clip=args.clip or 0.0, offload=args.offload, zero=zero)
    # clip=0.0 is "off", as without --clip in the DDP script: left out, DeepSpeed >= 0.19 clips at 1.0 by default
    if args.count_comms:
        config["comms_logger"] = {"enabled": True, "prof_all": True, "verbose": False}
    if args.optimizer == "sgd":  # any torch.optim class by name; ZeRO asks to be told it is untested with it
        config["optimizer"]["params"] = {"lr": args.lr, "momentum": args.momentum}
        config["zero_allow_untested_optimizer"] = True
    return config


@record
def main():
    args = parse_args()
    rank, local_rank, world_size = launched_ranks("deepspeed --num_gpus 2 course/ds_tuning.py")
    accel = get_accelerator()  # DeepSpeed's device abstraction (DS_ACCELERATOR=cpu: the CPU)
    accel.set_device(local_rank)
    device, backend = torch.device(accel.device_name(local_rank)), accel.communication_backend_name()
    deepspeed.init_distributed(dist_backend=backend)
    forget_deepspeed_shm_buffer(rank)  # DeepSpeed's CPU comm buffers would stay in RAM
    try:
        train(args, rank, world_size, device)
    finally:
        dist.destroy_process_group()


def train(args, rank, world_size, device):
    torch.manual_seed(args.seed)
    train_ds, _, info = harness.datasets(args)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    data = harness.batches(DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler), sampler)  # set_epoch
    rss_start = memory_now(device)["rss_mib"]  # before the model exists: the framework's own share

    model = harness.build_model(args, info.num_classes)
    params = count_parameters(model)  # before ZeRO-3 partitions them away
    # one call replaces DDP(...), the optimizer, the LR scheduler, clipping and mixed precision
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config(args, world_size))
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float32

    log0(f"world_size={world_size} backend={dist.get_backend()} device={device.type} params={params} "
         f"zero_stage={args.stage} global_batch={engine.train_batch_size()} steps={args.steps}")
    comm = harness.count_deepspeed_comms() if args.count_comms else None
    meter = harness.Meter(args.steps, device, world_size, samples_per_step=engine.train_batch_size(),
                          skip=args.skip_steps, memory=True, comm=comm, log_every=10)
    states = None
    for step in meter.steps():
        lr = engine.get_lr()[0]  # the rate this step uses; WarmupLR moves on inside engine.step()
        loss_sum = 0.0
        for micro in range(args.accumulation):
            images, labels = next(data)
            loss = F.cross_entropy(engine(images.to(device, dtype)), labels.to(device))
            engine.backward(loss)  # divides by gradient_accumulation_steps; reduces only at the boundary
            if states is None and step == 2:  # gradients live and optimizer state exists
                states = model_state_bytes(engine.module, engine.optimizer)
            engine.step()  # at the boundary: clip, optimizer and LR step, zero the gradients
            loss_sum += loss.item() / args.accumulation
        norm = engine.get_global_grad_norm()  # before clipping; None where nothing needed it (stage 0, no clip)
        meter.step(loss=loss_sum, lr=lr, samples=args.batch_size * args.accumulation,
                   **({} if norm is None else {"grad_norm": float(norm)}))
    meter.finish()

    checkpoint_bytes = None
    if args.save_dir:  # ALL ranks call it: under ZeRO each rank holds a shard no other rank has
        engine.save_checkpoint(args.save_dir)
        dist.barrier()
        checkpoint_bytes = dir_bytes(args.save_dir) if rank == 0 else None
    meter.rep.result(model_state_bytes=states, comm_per_step=meter.comm_per_step())  # every rank: its own
    meter.report(framework="deepspeed", zero_stage=args.stage, offload=args.offload,
                 dtype="bf16" if args.bf16 else "fp32", params=params, global_batch=engine.train_batch_size(),
                 rss_start_mib=rss_start, checkpoint_bytes=checkpoint_bytes)


if __name__ == "__main__":
    end_rank(main())  # exits without interpreter teardown: see helpers/rank/runtime.py
