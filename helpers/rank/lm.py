"""What the GPT scripts share and no lesson is about: their flags, the text data, the model from the flags, and the
held-out loss. The counterpart of :mod:`helpers.rank.harness` (whose :class:`~helpers.rank.harness.Meter` they use
too) for language modelling.

Example (inside a rank)::

    args = lm.parser("GPT training").parse_args()
    train_ds, test_ds, info = lm.datasets(args)          # rank 0 announces which text it is
    model = lm.build_gpt(args, info.vocab_size)
    ...
    lm.evaluate(model, test_ds, device)                  # mean next-character loss, the work split between ranks
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from . import memcap
from .gpt import ATTENTIONS, CHECKPOINTS, GPT, GPTConfig
from .harness import DTYPES, profile_flag  # DTYPES: the plain PyTorch scripts' --dtype (fp64 only to measure fp32 rounding)
from .runtime import log0
from .text import announcement, text_datasets



def parser(description: str, *, steps: int = 40) -> argparse.ArgumentParser:
    """The flags every GPT script shares: the run, the text and the model's shape."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--steps", type=int, default=steps, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank; global batch = this x data ranks")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dataset", choices=["auto", "file", "generated"], default="auto",
                   help="auto: <data-root>/text/input.txt when it is there, else generated text (announced)")
    p.add_argument("--data-root", default="data")
    p.add_argument("--train-windows", type=int, default=None, help="use only the first N training windows")
    p.add_argument("--test-windows", type=int, default=64, help="held-out windows for the test loss")
    p.add_argument("--skip-steps", type=int, default=5, help="warm-up steps left out of samples_per_s")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                   help="fp64: measure the noise floor of fp32 rounding against this run (helpers/calc/parity.py)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (and the position embedding's size)")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--attention", choices=ATTENTIONS, default="math",
                   help="math: softmax(q k^T) v written out (saves the s x s scores); sdpa: the flash kernel")
    p.add_argument("--checkpoint", choices=CHECKPOINTS, default="none",
                   help="activation checkpointing: selective (the attention core) or full (every block)")
    return profile_flag(p)


def gpt_config(args, vocab_size: int) -> GPTConfig:
    return GPTConfig(vocab_size=vocab_size, seq_len=args.seq_len, n_layer=args.n_layer, n_head=args.n_head,
                     d_model=args.d_model, attention=args.attention, checkpoint=args.checkpoint)


def build_gpt(args, vocab_size: int) -> GPT:
    """The GPT of the flags, in ``--dtype``, from ``--seed``: the same weights on every rank, and the same as a GPT
    built on the meta device and materialised with ``to_empty`` + ``init_weights(args.seed)``."""
    torch.manual_seed(args.seed)
    model = GPT(gpt_config(args, vocab_size))
    model.init_weights(args.seed)  # reseeded: the weights do not depend on what the constructors drew
    return model.to(DTYPES[args.dtype])


def datasets(args):
    """(train, test, info) from the flags; rank 0 announces the text (a corpus on disk, or generated)."""
    train, test, info = text_datasets(args.seq_len, args.data_root, args.dataset, args.seed, args.train_windows)
    if args.test_windows is not None and args.test_windows < len(test):
        test = torch.utils.data.Subset(test, range(args.test_windows))
    memcap.apply_from_env()
    log0(announcement(info))
    return train, test, info


@torch.no_grad()
def evaluate(model, test_ds, device, *, batch_size: int = 32, split: bool = True) -> float:
    """Mean next-token loss over ``test_ds``. ``split``: each rank takes every WORLD_SIZE-th window and the sums are
    all-reduced (a data-parallel model); ``split=False``: every rank runs every window (a model whose ranks must all
    join each forward, such as a tensor-parallel one)."""
    was_training = model.training
    model.eval()
    rank, world = (dist.get_rank(), dist.get_world_size()) if split and dist.is_initialized() else (0, 1)
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for start in range(rank * batch_size, len(test_ds), world * batch_size):
        xs, ys = zip(*(test_ds[i] for i in range(start, min(start + batch_size, len(test_ds)))))
        _, loss = model(torch.stack(xs).to(device), torch.stack(ys).to(device))
        total += torch.tensor([loss.item() * len(xs), len(xs)], dtype=torch.float64, device=device)
    if world > 1:
        dist.all_reduce(total)
    model.train(was_training)
    return float(total[0] / total[1])
