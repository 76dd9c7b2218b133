"""Exercise task: the learner runs a GPT's blocks under activation checkpointing, inside DDP.

    torchrun --nproc-per-node 2 helpers/rank/exercises/checkpointing.py --answer answer.py

The learner's ``run_blocks(blocks, x)`` returns the blocks' output for the hidden states ``x``, each block wrapped
in ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``. Each rank trains a DDP copy of a small GPT with
it for a few steps on its own batch, and the same steps with the plain loop in float32 and float64 (their gap is the
rounding floor the checker's tolerance is built on). It records the losses, the gradients after the first step (as a
fingerprint: two numbers per parameter), the bytes MemTracker labels activations right after the forward (both
ways), and the formula's figures for the shape.
"""
import argparse
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers.calc import activations
from helpers.rank.exercises import load_answer, run_task
from helpers.rank.gpt import GPT, GPTConfig
from helpers.rank.runtime import end_rank, launched_ranks

SHAPE = dict(seq_len=32, batch=4, d_model=64, n_head=4, n_layer=4, vocab=16)
STEPS, LR = 3, 0.01


def plain_blocks(blocks, x):
    for block in blocks:
        x = block(x)
    return x


class WithBlocks(nn.Module):
    """The GPT's forward with its block loop replaced by ``run_blocks``."""

    def __init__(self, gpt: GPT, run_blocks):
        super().__init__()
        self.gpt, self.run_blocks = gpt, run_blocks

    def forward(self, idx, targets):
        g = self.gpt
        x = g.tok_emb(idx) + g.pos_emb(torch.arange(idx.size(1)))
        logits = g.head(g.ln_f(self.run_blocks(g.blocks, x)))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batch(rank: int):
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own sequences, as under DDP
    return [torch.randint(SHAPE["vocab"], (SHAPE["batch"], SHAPE["seq_len"]), generator=g) for _ in range(2)]


def act_bytes(model, idx, targets) -> int:
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        loss = model(idx, targets)
        held = tracker.get_tracker_snapshot("current")[torch.device("cpu")][_MemRefType.ACT]
        loss.backward()
    model.zero_grad(set_to_none=True)
    return held


def gradient_fingerprint(params) -> list[float]:
    """Each parameter's gradient (zero where it has none) as two numbers: its sum, and its dot product with fixed
    random weights (seeded by the parameter's place, so the same in every run). A gradient that differs anywhere
    moves the second; the record stays a few hundred numbers instead of every element of the model."""
    out = []
    for i, p in enumerate(params):
        g = (torch.zeros_like(p) if p.grad is None else p.grad).double()
        w = torch.randn(g.shape, generator=torch.Generator().manual_seed(i), dtype=torch.float64)
        out += [g.sum().item(), (g * w).sum().item()]
    return out


def train(gpt, run_blocks, rank, dtype):
    # find_unused_parameters: a run_blocks that drops the blocks' output leaves them without gradients
    ddp = DDP(WithBlocks(copy.deepcopy(gpt).to(dtype), run_blocks), find_unused_parameters=True)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LR)
    idx, targets = batch(rank)
    losses, grads = [], None
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = ddp(idx, targets)
        loss.backward()
        if grads is None:
            grads = gradient_fingerprint(ddp.parameters())
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads}


def main() -> int:
    rank, _, world = launched_ranks("torchrun --nproc-per-node 2 helpers/rank/exercises/checkpointing.py --answer F")
    parser = argparse.ArgumentParser()
    parser.add_argument("--answer", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    run_blocks = load_answer(args.answer, "run_blocks")

    def task():
        s = SHAPE
        cfg = GPTConfig(vocab_size=s["vocab"], seq_len=s["seq_len"], n_layer=s["n_layer"], n_head=s["n_head"],
                        d_model=s["d_model"])
        gpt = GPT(cfg)
        gpt.init_weights(0)
        reference = {name: train(gpt, plain_blocks, rank, dtype)
                     for name, dtype in (("fp32", torch.float32), ("fp64", torch.float64))}
        skipped = train(gpt, lambda blocks, x: x, rank, torch.float32)["losses"]  # the blocks' work lost
        theirs = train(gpt, run_blocks, rank, torch.float32)
        idx, targets = batch(rank)
        formula = {mode: activations.model_bytes(s["seq_len"], s["batch"], s["d_model"], s["n_head"], s["n_layer"],
                                                 s["vocab"], checkpoint=mode) for mode in ("none", "full")}
        return {"world_size": world, "reference": reference, "skipped": skipped, "theirs": theirs,
                "act_plain": act_bytes(WithBlocks(gpt, plain_blocks), idx, targets),
                "act_theirs": act_bytes(WithBlocks(gpt, run_blocks), idx, targets),
                "formula": formula}

    run_task(rank, task)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    end_rank(main())
