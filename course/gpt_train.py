"""Train the course's small GPT on text with DDP, one process per rank: the model of chapters 08-10.

Run it from any directory, in a terminal (after `pip install -e .`, which `make setup` does):

    torchrun --nproc-per-node 2 course/gpt_train.py --steps 60
    torchrun --nproc-per-node 1 course/gpt_train.py --checkpoint full --n-layer 4 --seq-len 128

The loop is course/ddp_cifar10.py's with a GPT (helpers/rank/gpt.py) and characters instead of images: each rank
takes its share of the text's windows (DistributedSampler), predicts every next character, and DDP averages the
gradients. The text is data/text/input.txt when it is there, else generated sentences (announced). The run reports
the unigram baseline (predicting each character from its frequency alone) next to the training and held-out loss,
so you can see the model learn more than character counts. course/gpt_tp.py is this script with tensor
parallelism instead of DDP.
"""
import itertools

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from helpers.rank import harness, lm
from helpers.rank.devices import rank_device
from helpers.rank.models import count_parameters
from helpers.rank.runtime import end_rank, launched_ranks, log0


def parse_args():
    return lm.parser("DDP training of a small GPT on text (launch with torchrun).").parse_args()


@record
def main():
    args = parse_args()
    rank, local_rank, world_size = launched_ranks("torchrun --nproc-per-node 2 course/gpt_train.py")
    device, backend = rank_device(local_rank)
    dist.init_process_group(backend)
    try:
        train(args, world_size, device)
    finally:
        dist.destroy_process_group()


def train(args, world_size, device):
    train_ds, test_ds, info = lm.datasets(args)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    model = lm.build_gpt(args, info.vocab_size).to(device)  # the same weights on every rank (seeded)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=0.0)
    log0(f"world_size={world_size} params={count_parameters(model)} gpt={model.cfg.as_dict()} "
         f"global_batch={args.batch_size * world_size} sequences of {args.seq_len}")

    meter = harness.Meter(args.steps, device, world_size, samples_per_step=args.batch_size * world_size,
                          skip=args.skip_steps)
    for epoch in itertools.count():
        if meter.done >= args.steps:
            break
        sampler.set_epoch(epoch)
        for x, y in meter.batches(loader):
            x, y = x.to(device), y.to(device)
            _, loss = ddp(x, y)  # the mean next-character loss of this rank's sequences
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP all-reduces the gradients: every rank gets the mean over the global batch
            optimizer.step()
            meter.step(loss=loss.item(), epoch=epoch, samples=x.size(0))
    run = meter.finish()

    test_loss = lm.evaluate(model, test_ds, device)
    log0(f"test loss {test_loss:.3f} nats/char (unigram baseline {info.unigram_loss:.3f}) | "
         f"{run['train_seconds']:.1f} s training | {meter.throughput_line()}")
    meter.report(framework="ddp", test_loss=test_loss, unigram_loss=info.unigram_loss, vocab_size=info.vocab_size,
                 dataset=info.name, params=count_parameters(model), global_batch=args.batch_size * world_size,
                 gpt=model.cfg.as_dict(), dtype=args.dtype)


if __name__ == "__main__":
    end_rank(main())
