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
