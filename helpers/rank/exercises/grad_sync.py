"""Exercise task: the learner averages the gradients by hand after the backward, in one all-reduce (no overlap).

    torchrun --nproc-per-node 3 helpers/rank/exercises/grad_sync.py --answer answer.py

Every rank builds the same small MLP (one seed) and a batch of its own (seeded by rank), runs the forward and
backward without DDP, and calls the learner's ``average_gradients(model)``. The rank records its gradients before
and after, how many all-reduces the learner issued (counted at the process group,
:class:`helpers.rank.exercises.traffic.Traffic`), and the gradients DDP computes from the same weights and batch in
float32 and float64 (their gap is the rounding floor of the checker's tolerance). Then the same again on one rank
fewer, in a new process group without the last rank: an answer that hard-codes the rank count fails one of the two.
"""
import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers.rank.exercises import load_answer, one_rank_fewer, run_task
from helpers.rank.exercises.traffic import Traffic
from helpers.rank.runtime import end_rank, launched_ranks

BATCH, WIDTH, LAYERS = 8, 16, 3


def model_and_batch(dtype, rank: int):
    torch.manual_seed(0)  # the same weights on every rank
    model = nn.Sequential(*[m for _ in range(LAYERS) for m in (nn.Linear(WIDTH, WIDTH), nn.Tanh())][:-1]).to(dtype)
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own batch
    x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)
    return model, x.to(dtype), y.to(dtype)


def grads(model: nn.Module) -> list[float]:
    return [v for p in model.parameters() for v in ([] if p.grad is None else p.grad.flatten().tolist())]


def ddp_grads(dtype, rank: int) -> list[float]:
    model, x, y = model_and_batch(dtype, rank)
    ddp = DDP(model)
    nn.functional.mse_loss(ddp(x), y).backward()
    return grads(model)


def one_run(average_gradients, rank: int, world: int) -> dict:
    """DDP's gradients and the learner's, on the process group up now (``world`` ranks)."""
    fields = {"world_size": world, "fp32": ddp_grads(torch.float32, rank), "fp64": ddp_grads(torch.float64, rank)}
    model, x, y = model_and_batch(torch.float32, rank)
    nn.functional.mse_loss(model(x), y).backward()
    fields["local"] = grads(model)
    with Traffic() as traffic:  # every all-reduce, under whatever name the learner called it
        average_gradients(model)
    fields.update(answer=grads(model), all_reduce_calls=len(traffic.elements("allreduce")),
                  all_reduce_elements=traffic.elements("allreduce"), collectives=traffic.collectives(),
                  parameters=sum(1 for _ in model.parameters()))
    return fields


def main() -> int:
    rank, _, world = launched_ranks("torchrun --nproc-per-node 3 helpers/rank/exercises/grad_sync.py --answer FILE")
    parser = argparse.ArgumentParser()
    parser.add_argument("--answer", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    average_gradients = load_answer(args.answer, "average_gradients")
    store = dist.distributed_c10d._get_default_store()

    def task():
        runs = [one_run(average_gradients, rank, world)]
        if world > 2 and one_rank_fewer(rank, world, store):  # a hard-coded rank count is right at most once
            runs.append(one_run(average_gradients, rank, world - 1))
        return {"world_size": world, "runs": runs}

    run_task(rank, task)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    end_rank(main())
