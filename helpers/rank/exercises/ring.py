"""Exercise task: the learner's ring all-reduce, run on every rank and compared with the sum it must give.

    torchrun --nproc-per-node 3 helpers/rank/exercises/ring.py --answer answer.py

Each case fills a tensor with small whole numbers (float32 sums of those are exact in any order, so the comparison
is exact), calls the learner's ``ring_all_reduce(tensor)``, and records whether every element is the sum over ranks,
the bytes this rank sent point-to-point, and any built-in collective it ran instead, however it was reached
(:class:`helpers.rank.exercises.traffic.Traffic` counts at the process group, below every name of a function).
Then the same on one rank fewer (a new process group without the last rank), where there are more than 2.
"""
import argparse

import torch
import torch.distributed as dist

from helpers.rank.exercises import load_answer, one_rank_fewer, run_task
from helpers.rank.exercises.traffic import Traffic
from helpers.rank.runtime import end_rank, launched_ranks


def case_sizes(world: int) -> list[int]:
    """A size that splits evenly, one that does not, and one with fewer elements than ranks."""
    return [4 * world, 4 * world + 1, max(world - 1, 1)]


def rank_tensor(numel: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * numel + rank)
    return torch.randint(0, 10, (numel,), generator=g).float()


def main() -> int:
    rank, _, world = launched_ranks("torchrun --nproc-per-node 3 helpers/rank/exercises/ring.py --answer FILE")
    parser = argparse.ArgumentParser()
    parser.add_argument("--answer", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    ring_all_reduce = load_answer(args.answer, "ring_all_reduce")

    store = dist.distributed_c10d._get_default_store()

    def one_run(world: int) -> dict:
        cases, built_ins = [], set()
        for numel in case_sizes(world):
            x = rank_tensor(numel, rank)
            with Traffic() as traffic:
                returned = ring_all_reduce(x)
            built_ins |= set(traffic.collectives())
            got = returned if isinstance(returned, torch.Tensor) else x
            expected = sum(rank_tensor(numel, r) for r in range(world))
            cases.append({"numel": numel, "bytes": 4 * numel, "sent_bytes": traffic.sent_bytes,
                          "shape_ok": got.shape == expected.shape,
                          "correct": got.shape == expected.shape and torch.equal(got, expected),
                          "elements_right": int((got == expected).sum()) if got.shape == expected.shape else 0,
                          "is_mean": got.shape == expected.shape and torch.allclose(got, expected / world),
                          "unchanged": got.shape == x.shape and torch.equal(got, rank_tensor(numel, rank))})
        return {"world_size": world, "cases": cases, "built_ins": sorted(built_ins)}

    def task():
        runs = [one_run(world)]
        if world > 2 and one_rank_fewer(rank, world, store):  # a ring written for one rank count fails the other
            runs.append(one_run(world - 1))
        return {"world_size": world, "runs": runs}

    run_task(rank, task)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    end_rank(main())
