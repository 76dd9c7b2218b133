"""Exercise task: the learner's ring all-reduce, run on every rank and compared with the sum it must give.

    torchrun --nproc-per-node 3 helpers/rank/exercises/ring.py --answer answer.py

Each case fills a tensor with small whole numbers (float32 sums of those are exact in any order, so the comparison
is exact), calls the learner's ``ring_all_reduce(tensor)``, and records whether every element is the sum over ranks,
the bytes this rank sent with send/isend, and any built-in collective it called instead.
"""
import argparse

import torch
import torch.distributed as dist

from helpers.rank.exercises import load_answer, run_task
from helpers.rank.runtime import end_rank, launched_ranks

# the learner builds all-reduce from point-to-point messages; these would do the work for them
BUILT_INS = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
             "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter")


def case_sizes(world: int) -> list[int]:
    """A size that splits evenly, one that does not, and one with fewer elements than ranks."""
    return [4 * world, 4 * world + 1, max(world - 1, 1)]


def rank_tensor(numel: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * numel + rank)
    return torch.randint(0, 10, (numel,), generator=g).float()


class Traffic:
    """Counts what this rank sends, and which built-in collectives it calls, by wrapping torch.distributed's
    functions (the learner's code looks them up on the module at each call)."""

    def __init__(self):
        self.sent_bytes = 0
        self.built_ins: set[str] = set()
        for name in ("send", "isend"):
            self._wrap(name, self._count)
        for name in BUILT_INS:
            self._wrap(name, self._forbid)

    def _wrap(self, name, hook):
        real = getattr(dist, name)

        def wrapped(*args, **kwargs):
            hook(name, args, kwargs)
            return real(*args, **kwargs)
        setattr(dist, name, wrapped)

    def _count(self, name, args, kwargs):
        tensor = kwargs.get("tensor", args[0] if args else None)
        self.sent_bytes += tensor.numel() * tensor.element_size()

    def _forbid(self, name, args, kwargs):
        self.built_ins.add(name)


def main() -> int:
    rank, _, world = launched_ranks("torchrun --nproc-per-node 3 helpers/rank/exercises/ring.py --answer FILE")
    parser = argparse.ArgumentParser()
    parser.add_argument("--answer", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    ring_all_reduce = load_answer(args.answer, "ring_all_reduce")

    def task():
        traffic, cases = Traffic(), []
        for numel in case_sizes(world):
            x = rank_tensor(numel, rank)
            start = traffic.sent_bytes
            returned = ring_all_reduce(x)
            got = returned if isinstance(returned, torch.Tensor) else x
            expected = sum(rank_tensor(numel, r) for r in range(world))
            cases.append({"numel": numel, "bytes": 4 * numel, "sent_bytes": traffic.sent_bytes - start,
                          "shape_ok": got.shape == expected.shape,
                          "correct": got.shape == expected.shape and torch.equal(got, expected),
                          "elements_right": int((got == expected).sum()) if got.shape == expected.shape else 0,
                          "is_mean": got.shape == expected.shape and torch.allclose(got, expected / world),
                          "unchanged": got.shape == x.shape and torch.equal(got, rank_tensor(numel, rank))})
        return {"world_size": world, "cases": cases, "built_ins": sorted(traffic.built_ins)}

    run_task(rank, task)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    end_rank(main())
