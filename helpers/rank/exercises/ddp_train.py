"""Exercise task: the learner's one-process training loop made distributed, run on every rank.

    torchrun --nproc-per-node 2 helpers/rank/exercises/ddp_train.py --answer answer.py

Each rank builds the model from a different seed (as separate processes do unless rank 0's weights are broadcast)
and a small data set that remembers which samples this rank read. After the learner's ``train(model, dataset,
epochs)`` returns, the rank records its final weights, whether they moved, and the samples it read in each epoch.
"""
import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

from helpers.rank.exercises import load_answer, run_task
from helpers.rank.runtime import end_rank, launched_ranks

SAMPLES, FEATURES, EPOCHS = 48, 8, 2


class RecordingData(Dataset):
    """A fixed two-class problem; ``reads`` lists every index asked for, in order."""

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(SAMPLES, FEATURES, generator=g)
        self.y = (self.x[:, 0] > 0).long()
        self.reads: list[int] = []

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        self.reads.append(int(i))
        return self.x[i], self.y[i]


def weights(model: nn.Module) -> list[float]:
    model = getattr(model, "module", model)  # DDP keeps the model it wraps as .module
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


def main() -> int:
    rank, _, world = launched_ranks("torchrun --nproc-per-node 2 helpers/rank/exercises/ddp_train.py --answer FILE")
    parser = argparse.ArgumentParser()
    parser.add_argument("--answer", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    train = load_answer(args.answer, "train")

    def task():
        torch.manual_seed(rank)  # a different start on every rank, on purpose
        model, data = nn.Linear(FEATURES, 2), RecordingData()
        start = weights(model)
        returned = train(model, data, EPOCHS)
        final = weights(returned if isinstance(returned, nn.Module) else model)
        per_epoch = len(data.reads) // EPOCHS if data.reads else 0
        return {"world_size": world, "start": start, "final": final, "samples": SAMPLES,
                "reads": [data.reads[e * per_epoch:(e + 1) * per_epoch] for e in range(EPOCHS)],
                "reads_total": len(data.reads)}

    run_task(rank, task)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    end_rank(main())
