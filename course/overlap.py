"""When a step's communication runs: DDP's buckets during the backward or after it, FSDP2's gathers before each layer.

    torchrun --nproc-per-node 2 course/overlap.py --mode buckets --profile-steps 3
    torchrun --nproc-per-node 2 course/overlap.py --mode buckets one-bucket fsdp2 --profile-steps 3

One MLP of 8 equal linear layers (generated data, announced), its gradients averaged six ways:

* buckets:        DDP with small buckets (--bucket-mb 4: one 1024 x 1024 layer each). Autograd finishes the last
                  layer's gradients first; as soon as a bucket is full, DDP starts its all-reduce, while the backward
                  goes on with the layers before it.
* one-bucket:     DDP with a bucket cap larger than the model: one bucket, whose all-reduce can start only when the
                  backward has produced every gradient.
* no-overlap:     the backward under ddp.no_sync() (no all-reduce at all), then one all-reduce of all the gradients,
                  flattened into one tensor, after the backward: the sum DDP computes, none of it hidden.
* fsdp2:          fully_shard on every layer: each rank keeps 1/N of each layer, all-gathers a layer before its
                  forward and again before its backward (reshard_after_forward=True), and reduce-scatters its
                  gradient after.
* fsdp2-keep:     reshard_after_forward=False: the gathered layers stay until the backward (ZeRO-2-like): no second
                  gather, more memory.
* fsdp2-prefetch: as fsdp2, and each layer asks for the next two layers' gathers (explicit prefetch,
                  set_modules_to_forward_prefetch / set_modules_to_backward_prefetch) instead of FSDP2's one.

All six compute the same mean gradient; what changes is when the communication runs and how much of it there is.
With --profile-steps N each rank writes a torch.profiler trace of N steps to the run directory;
helpers/calc/traces.py splits each step into compute, communication and exposed communication. Given several modes,
one launch trains them one after another, from the same weights, each writing its metrics and traces into a folder
of the run directory named after it: the start-up of torchrun and of every rank (seconds on a CPU) is paid once.
"""
import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers.rank import harness
from helpers.rank.devices import rank_device
from helpers.rank.metrics import RUN_DIR_ENV
from helpers.rank.runtime import end_rank, launched_ranks, log0

MODES = ("buckets", "one-bucket", "no-overlap", "fsdp2", "fsdp2-keep", "fsdp2-prefetch")


def parse_args():
    p = harness.profile_flag(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--mode", choices=MODES, nargs="+", default=["buckets"],
                   help="one or more: with several, each trains in turn into a folder of the run directory")
    p.add_argument("--width", type=int, default=1024, help="features of each layer")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--skip-steps", type=int, default=2, help="warm-up steps: DDP builds its buckets in the first")
    p.add_argument("--bucket-mb", type=float, default=4.0, help="bucket cap of the buckets mode, MiB")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def mlp(width: int, layers: int) -> torch.nn.Sequential:
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*blocks[:-1])


def all_reduce_after_backward(model: torch.nn.Module, world_size: int) -> None:
    """What DDP does, done after the backward: all gradients in one flat tensor, one all-reduce, the mean."""
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= world_size
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


def wrap(model: torch.nn.Sequential, mode: str, args, device):
    """The model as the mode trains it: DDP with its bucket cap, or FSDP2 on every linear layer and the root."""
    if mode.startswith("fsdp2"):
        layers = [m for m in model if isinstance(m, torch.nn.Linear)]
        for layer in layers:
            fully_shard(layer, reshard_after_forward=mode != "fsdp2-keep")
        fully_shard(model)
        if mode == "fsdp2-prefetch":
            for i, layer in enumerate(layers):
                layer.set_modules_to_forward_prefetch(layers[i + 1:i + 3])
                layer.set_modules_to_backward_prefetch(layers[max(0, i - 2):i][::-1])
        return model
    cap = args.bucket_mb if mode == "buckets" else 1e6  # MiB: larger than any model here
    return DDP(model, bucket_cap_mb=cap, device_ids=[device.index] if device.type == "cuda" else None)


@record
def main():
    args = parse_args()
    rank, local_rank, world_size = launched_ranks("torchrun --nproc-per-node 2 course/overlap.py")
    device, backend = rank_device(local_rank)
    dist.init_process_group(backend)
    run_dir = Path(os.environ.get(RUN_DIR_ENV) or ".")
    try:
        modes = list(dict.fromkeys(args.mode))
        for mode in modes:
            if len(modes) > 1:  # each mode's metrics and trace_rank*.json in a folder of its own
                (run_dir / mode).mkdir(exist_ok=True)
                os.environ[RUN_DIR_ENV] = str(run_dir / mode)
            train(args, mode, rank, world_size, device)
    finally:
        dist.destroy_process_group()


def train(args, mode, rank, world_size, device):
    torch.manual_seed(args.seed)  # the same weights on every rank
    model = mlp(args.width, args.layers).to(device)
    grad_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    wrapped = wrap(model, mode, args, device)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(args.seed + 1 + rank)  # each rank its own batches (generated data)
    log0(f"mode={mode} world_size={world_size} layers={args.layers}x{args.width} gradients={grad_mib:.0f} MiB "
         f"data=generated (random inputs and targets)")

    meter = harness.Meter(args.steps, device, world_size, samples_per_step=args.batch_size * world_size,
                          skip=args.skip_steps)
    for _ in meter.steps():
        x = torch.randn(args.batch_size, args.width, generator=gen).to(device)
        y = torch.randn(args.batch_size, args.width, generator=gen).to(device)
        optimizer.zero_grad(set_to_none=True)
        if mode == "no-overlap":
            with wrapped.no_sync():  # DDP's hooks stay quiet: no all-reduce during the backward
                loss = torch.nn.functional.mse_loss(wrapped(x), y)
                loss.backward()
            all_reduce_after_backward(model, world_size)
        else:
            loss = torch.nn.functional.mse_loss(wrapped(x), y)
            loss.backward()  # DDP: buckets all-reduce as they fill; FSDP2: gathers and reduce-scatters per layer
        optimizer.step()
        meter.step(loss=loss.item(), samples=x.size(0))
    run = meter.finish()
    log0(f"{run['train_seconds']:.1f} s training | {meter.throughput_line()}")
    fields = dict(ddp_sync=mode, grad_mib=grad_mib)
    if isinstance(wrapped, DDP):
        # the buckets DDP settled on after the first step (rebuilt in the order the gradients arrived), bytes
        logged = str(wrapped._get_ddp_logging_data().get("rebuilt_bucket_sizes", ""))
        fields.update(bucket_cap_mb=wrapped.bucket_bytes_cap / 2**20, ddp_buckets=[int(b) for b in logged.split(",")
                                                                                   if b])
    else:
        fields.update(reshard_after_forward=mode != "fsdp2-keep")
    meter.report(framework="fsdp2" if mode.startswith("fsdp2") else "ddp", **fields)


if __name__ == "__main__":
    end_rank(main())
