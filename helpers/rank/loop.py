"""Small pieces the training loops of ``course/`` share; the distributed lines themselves stay in each script.

Example (inside a rank)::

    data = batches(DataLoader(train_ds, batch_size=32, sampler=sampler), sampler)
    images, labels = next(data)                       # steps, not epochs: reshuffled at each epoch's end
    ddp.register_comm_hook(counter, counting_hook)    # counter = {"calls": 0, "bytes": 0}
"""
from __future__ import annotations


def batches(loader, sampler):
    """Micro batches forever, reshuffled each epoch (``sampler.set_epoch``): for loops that count steps, not epochs."""
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def counting_hook(counter: dict, bucket):
    """A DDP communication hook: count the calls and bytes of every gradient bucket, then all-reduce it as usual.

    ``counter`` is the hook's state, ``{"calls": 0, "bytes": 0}``, passed to ``ddp.register_comm_hook(counter,
    counting_hook)``; it ends up holding what this rank handed to all-reduce."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    counter["calls"] += 1
    counter["bytes"] += bucket.buffer().numel() * bucket.buffer().element_size()
    return allreduce_hook(None, bucket)


def tuning_parser(description: str):
    """The flags course/ddp_tuning.py and its DeepSpeed twin course/ds_tuning.py share: the same run, model, data and
    training knobs, so a diff of the two scripts shows only what the DeepSpeed engine changes. Each script adds its
    own flags (``--compile``; ``--stage``, ``--offload`` ...) to the parser this returns."""
    import argparse

    p = argparse.ArgumentParser(description=description)
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=32, help="micro batch per rank")
    p.add_argument("--accumulation", type=int, default=1, help="micro batches per optimizer step")
    p.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    p.add_argument("--clip", type=float, default=None, help="max global gradient norm (off without it)")
    p.add_argument("--warmup-steps", type=int, default=0, help="linear LR warmup from 0 over this many steps")
    p.add_argument("--bf16", action="store_true",
                   help="bf16: autocast in the DDP script; bf16 weights and gradients with an fp32 master copy in DeepSpeed")
    p.add_argument("--model", choices=["cnn", "memory"], default="cnn", help="memory: a wide MLP of --params")
    p.add_argument("--params", type=int, default=20_000_000, help="parameters of --model memory")
    p.add_argument("--depth", type=int, default=4, help="layers of --model memory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dataset", choices=["auto", "cifar10", "synthetic"], default="auto")
    p.add_argument("--data-root", default="data")
    p.add_argument("--train-size", type=int, default=None, help="use a subset of the training images")
    p.add_argument("--save-dir", default=None, help="save a checkpoint here at the end")
    return p
