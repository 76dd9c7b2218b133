"""Exercise task: the learner makes a DDP training loop resumable, and the run is killed in the middle of a save.

    torchrun --nproc-per-node 2 helpers/rank/exercises/resume.py --answer answer.py --ckpt DIR --phase crash
    torchrun --nproc-per-node 2 helpers/rank/exercises/resume.py --answer answer.py --ckpt DIR --phase resume

The learner writes ``save_checkpoint(path, model, optimizer, step)`` (called after every step) and
``load_checkpoint(path, model, optimizer) -> the step to run next`` (called at start when ``path`` exists). In the
crash phase rank 0 dies while writing step FAULT_STEP's checkpoint: ``torch.save`` writes half its bytes and the
process exits, as a killed job would. The resume phase loads, trains to the end and records its weights next to an
uninterrupted run of the same steps: resuming is right when the two are bitwise equal. Every ``torch.save`` call is
logged per rank (``saves-rank<k>.txt``), so saving from every rank is seen even in a run that dies.
"""
import argparse
import io
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers.rank.exercises import load_answer, run_task
from helpers.rank.runtime import end_rank, launched_ranks

STEPS, FAULT_STEP, FEATURES = 8, 5, 8
KILLED = "killed-mid-save"


def data(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(6, FEATURES, generator=g)
    return x, (x[:, 0] > 0).long()


def fresh():
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Linear(16, 2)))
    return model, torch.optim.Adam(model.parameters(), lr=0.01)  # Adam: its moments are training state too


def one_step(model, optimizer, step, rank):
    x, y = data(step, rank)
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()


def weights(model) -> list[float]:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


class SaveWatch:
    """Wraps torch.save: logs every call per rank, and in the crash phase kills rank 0 half-way through a save."""

    def __init__(self, rank: int, ckpt: Path, crash: bool):
        self.rank, self.crash, self.step = rank, crash, None
        self.log = ckpt / f"saves-rank{rank}.txt"
        self.real = torch.save
        torch.save = self

    def __call__(self, obj, f, *args, **kwargs):
        with open(self.log, "a") as log:
            log.write(f"{self.step}\n")
        if not (self.crash and self.rank == 0 and self.step == FAULT_STEP):
            return self.real(obj, f, *args, **kwargs)
        buffer = io.BytesIO()
        self.real(obj, buffer, *args, **kwargs)
        half = buffer.getvalue()[: len(buffer.getvalue()) // 2]
        if isinstance(f, (str, os.PathLike)):
            with open(f, "wb") as out:
                out.write(half)
        else:
            f.write(half)
            f.flush()
        (self.log.parent / KILLED).write_text(f"{FAULT_STEP}\n")  # for the checker: the fault did happen
        os._exit(137)  # killed mid-save, like SIGKILL: nothing after this line runs


def main() -> int:
    rank, _, world = launched_ranks("torchrun --nproc-per-node 2 helpers/rank/exercises/resume.py --answer F ...")
    parser = argparse.ArgumentParser()
    parser.add_argument("--answer", required=True)
    parser.add_argument("--ckpt", required=True, type=Path)
    parser.add_argument("--phase", choices=("crash", "resume"), required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    save_checkpoint = load_answer(args.answer, "save_checkpoint")
    load_checkpoint = load_answer(args.answer, "load_checkpoint")
    path = str(args.ckpt / "checkpoint.pt")

    def task():
        reference = None
        if args.phase == "resume":
            model, optimizer = fresh()
            for step in range(STEPS):
                one_step(model, optimizer, step, rank)
            reference = weights(model)
        watch = SaveWatch(rank, args.ckpt, crash=args.phase == "crash")
        model, optimizer = fresh()
        start = load_checkpoint(path, model, optimizer) if os.path.exists(path) else 0
        for step in range(start, STEPS):
            one_step(model, optimizer, step, rank)
            watch.step = step
            save_checkpoint(path, model, optimizer, step)
            dist.barrier()  # the course's loops meet here too; a rank that dies in a save stops the rest
        return {"world_size": world, "phase": args.phase, "start": start, "fault_step": FAULT_STEP,
                "final": weights(model), "reference": reference}

    run_task(rank, task)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    end_rank(main())
