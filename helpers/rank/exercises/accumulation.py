"""Exercise task: the learner's gradient-accumulation step under DDP, with ``no_sync``.

    torchrun --nproc-per-node 2 helpers/rank/exercises/accumulation.py --answer answer.py

The learner's ``train_step(model, optimizer, micro_batches)`` takes a DDP model, its optimizer and this rank's
micro-batches and makes one optimizer step. A communication hook counts DDP's all-reduces; after two steps the rank
records them, its weights, and the weights one process gets from the same steps on every rank's samples at once
(in float32 and float64: their gap is the rounding floor the checker's tolerance is built on).
"""
import argparse
import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers.rank.exercises import load_answer, run_task
from helpers.rank.runtime import end_rank, launched_ranks

MICRO, MICRO_BATCH, STEPS, FEATURES, LR = 4, 3, 2, 8, 0.1


def samples(step: int, rank: int, micro: int):
    g = torch.Generator().manual_seed(10_000 * step + 100 * rank + micro)
    x = torch.randn(MICRO_BATCH, FEATURES, generator=g)
    return x, (x[:, 0] > 0).long()


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten().double() for p in getattr(model, "module", model).parameters()])


def one_process(model, world: int, dtype, variant: str = "right") -> list[float]:
    """The same steps on one process: each step's gradient is the mean over every rank's micro-batches. The variants
    are two classic mistakes, for the checker to recognise: "unscaled" (micro-batch losses summed, not averaged) and
    "last_only" (gradients zeroed before every micro-batch, so only the last one counts)."""
    model = copy.deepcopy(model).to(dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR * (MICRO if variant == "unscaled" else 1))
    for step in range(STEPS):
        micros = range(MICRO - 1, MICRO) if variant == "last_only" else range(MICRO)
        pieces = [samples(step, r, m) for r in range(world) for m in micros]
        x, y = torch.cat([p[0] for p in pieces]).to(dtype), torch.cat([p[1] for p in pieces])
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        (loss / MICRO if variant == "last_only" else loss).backward()
        optimizer.step()
    return flat(model).tolist()


def buckets(model) -> int:
    """How many all-reduces one ordinary (synchronising) backward of this model makes under DDP."""
    probe, calls = DDP(copy.deepcopy(model)), [0]

    def hook(state, bucket):
        calls[0] += 1
        return default_hooks.allreduce_hook(None, bucket)
    probe.register_comm_hook(None, hook)
    x, y = samples(0, 0, 0)
    nn.functional.cross_entropy(probe(x), y).backward()
    return calls[0]


def main() -> int:
    rank, _, world = launched_ranks("torchrun --nproc-per-node 2 helpers/rank/exercises/accumulation.py --answer F")
    parser = argparse.ArgumentParser()
    parser.add_argument("--answer", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    train_step = load_answer(args.answer, "train_step")

    def task():
        torch.manual_seed(0)
        plain = nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Linear(16, 2))
        reference = {"fp32": one_process(plain, world, torch.float32), "fp64": one_process(plain, world, torch.float64),
                     "unscaled": one_process(plain, world, torch.float32, "unscaled"),
                     "last_only": one_process(plain, world, torch.float32, "last_only")}
        model = DDP(plain)
        all_reduces = [0]

        def counting_hook(state, bucket):
            all_reduces[0] += 1
            return default_hooks.allreduce_hook(None, bucket)
        model.register_comm_hook(None, counting_hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        per_step = []
        for step in range(STEPS):
            before = all_reduces[0]
            train_step(model, optimizer, [samples(step, rank, m) for m in range(MICRO)])
            per_step.append(all_reduces[0] - before)
        return {"world_size": world, "micro_batches": MICRO, "all_reduces": per_step,
                "buckets": buckets(plain),
                "weights": flat(model).tolist(), "reference": reference}

    run_task(rank, task)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    end_rank(main())
