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
import os
import sys

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from helpers.calc import dsconfig
from helpers.rank import harness
from helpers.rank.deepspeed_facts import build_config, check_config
from helpers.rank.models import count_parameters
from helpers.rank.runtime import end_rank, forget_deepspeed_shm_buffer, launched_ranks, log0
from helpers.rank.state import model_state_bytes

NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def parse_args():
    p = harness.model_flags(harness.parser("DeepSpeed training of SimpleCNN on CIFAR-10 (launch with deepspeed).",
                                                steps_are="optimizer steps"))
    p.add_argument("--stage", type=int, choices=[0, 1, 2, 3], default=None, help="ZeRO stage (overrides the config)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None, help="precision (overrides the config)")
    p.add_argument("--save-dir", default=None, help="save a DeepSpeed checkpoint here at the end")
    p.add_argument("--load-dir", default=None, help="resume from the latest DeepSpeed checkpoint in this folder")
    p.add_argument("--local_rank", type=int, default=-1, help="passed by the deepspeed launcher (LOCAL_RANK is used)")
    return deepspeed.add_config_arguments(p).parse_args()  # adds --deepspeed_config


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
    torch.manual_seed(args.seed)  # same initial weights on every rank (DeepSpeed also broadcasts rank 0's)
    train_ds, test_ds, info = harness.datasets(args)  # rank 0 downloads (or generates) while the others wait

    model = harness.build_model(args, info.num_classes)  # SimpleCNN, or --model memory's wide MLP
    params = count_parameters(model)  # before ZeRO-3 partitions them away
    config = dsconfig.load(args.deepspeed_config) if args.deepspeed_config else build_config(
        micro_batch=args.batch_size, lr=args.lr, world_size=world_size)
    config = dsconfig.override(config, stage=args.stage, dtype=args.dtype)  # the flags win over the file
    check_config(config, world_size)  # a readable "what to change" instead of an assertion inside every rank
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
    accumulation = engine.gradient_accumulation_steps()
    total_steps = args.steps * accumulation if args.steps is not None else args.epochs * len(loader)
    log0(f"world_size={world_size} backend={dist.get_backend()} device={device.type} dtype={NAMES[dtype]} "
         f"zero_stage={engine.zero_optimization_stage()} params={params} global_batch={engine.train_batch_size()} "
         f"steps={total_steps}")
    meter = harness.Meter(total_steps, device, world_size, skip=args.skip_steps,
                          samples_per_step=engine.train_micro_batch_size_per_gpu() * world_size)
    first, model_states = engine.global_steps, None
    for epoch in range(-(-total_steps // len(loader))):
        sampler.set_epoch(epoch)  # a different shuffle each epoch, identical on all ranks
        for images, labels in meter.batches(loader):
            images, labels = images.to(device, dtype), labels.to(device)
            loss = F.cross_entropy(engine(images), labels)
            engine.backward(loss)  # averages gradients across ranks (ZeRO 2/3: each rank keeps its partition)
            if model_states is None and engine.global_steps == first + 1:  # gradients live, Adam state exists
                model_states = model_state_bytes(engine.module, engine.optimizer)  # this rank's share
            lr = engine.get_lr()[0]  # the rate this step uses; the LR schedule moves on inside engine.step()
            engine.step()  # every gradient_accumulation_steps: clip, optimizer and LR step, zero the gradients
            norm = engine.get_global_grad_norm()  # None until the first optimizer step
            meter.step(loss=loss.item(), epoch=epoch, samples=labels.size(0), lr=lr,
                       optimizer_step=engine.global_steps, **({} if norm is None else {"grad_norm": float(norm)}))
    run = meter.finish()

    accuracy = harness.evaluate(engine, test_ds, device, dtype=dtype)  # ZeRO-3: every forward is a collective
    checkpoint = None
    if args.save_dir:  # ALL ranks call it: under ZeRO each rank holds a shard of the state no other rank has
        engine.save_checkpoint(args.save_dir)
        checkpoint = os.path.join(args.save_dir, f"global_step{engine.global_steps}")

    log0(f"test accuracy {accuracy:.4f} on {len(test_ds)} images | {run['train_seconds']:.1f} s training | "
         f"{meter.throughput_line()}")
    meter.rep.result(model_state_bytes=model_states)  # every rank: what it held, for measured-vs-formula per rank
    meter.report(framework="deepspeed", test_accuracy=accuracy, global_batch=engine.train_batch_size(),
                 dataset=info.name, checkpoint=checkpoint, zero_stage=engine.zero_optimization_stage(),
                 dtype=NAMES[dtype], params=params, optimizer_steps=engine.global_steps)


if __name__ == "__main__":
    end_rank(main())  # exits without interpreter teardown: see helpers/rank/runtime.py
