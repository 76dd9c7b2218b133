"""Exercise task: the learner writes the 1F1B order of actions for one pipeline stage.

    torchrun --nproc-per-node 3 helpers/rank/exercises/pp_order.py --answer answer.py

The learner's ``one_f_one_b(stage, p, m)`` returns the actions stage ``stage`` of ``p`` runs in one step of ``m``
micro-batches, in order: ``("F", i)`` forward of micro-batch i, ``("B", i)`` its backward. Each rank runs torch's
``Schedule1F1B`` on a tiny pipeline (one Linear per stage) of p = N stages and of p = N - 1 (ranks 0..N-2, a group
of their own), each at m = p and 2p micro-batches (:func:`pipelines`), and records the order its stage actually
executed (helpers.rank.pipeline.StageClock), beside the learner's answer for the same (stage, p, m).
"""
import argparse

import torch
import torch.distributed as dist
import torch.distributed.pipelining as pipelining

from helpers.rank.exercises import load_answer, run_task
from helpers.rank.pipeline import StageClock
from helpers.rank.runtime import end_rank, launched_ranks


def torch_order(rank: int, world: int, m: int, group=None) -> list[list]:
    """The (kind, micro-batch) actions torch's Schedule1F1B ran on this rank's stage of ``world`` stages (the ranks
    of ``group``), in the order they started."""
    torch.manual_seed(0)
    clock = StageClock()
    stage = clock.watch(pipelining.PipelineStage(torch.nn.Linear(4, 4), rank, world, torch.device("cpu"),
                                                 group=group))
    schedule = pipelining.Schedule1F1B(stage, n_microbatches=m, loss_fn=lambda out, y: ((out - y) ** 2).mean())
    x = torch.randn(2 * m, 4)
    last = rank == world - 1
    schedule.step(*((x,) if rank == 0 else ()), target=x if last else None, losses=[] if last else None)
    return [[a[1], a[3]] for a in sorted(clock.actions, key=lambda a: a[4])]


def pipelines(world: int) -> list[tuple[int, int]]:
    """The (stages, micro-batches) cases: ``world`` stages and one fewer (at least 2), each at m = p and m = 2p
    (Schedule1F1B wants m >= p), so that an order hard-coded for one stage count is wrong at the other."""
    return [(p, m) for p in sorted({world, max(world - 1, 2)}) for m in (p, 2 * p)]


def main() -> int:
    rank, _, world = launched_ranks("torchrun --nproc-per-node 3 helpers/rank/exercises/pp_order.py --answer FILE")
    parser = argparse.ArgumentParser()
    parser.add_argument("--answer", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    one_f_one_b = load_answer(args.answer, "one_f_one_b")
    # every rank joins every group's creation; the pipeline of p stages runs on ranks 0..p-1
    groups = {p: dist.new_group(list(range(p))) if p < world else None for p, _m in pipelines(world)}

    def task():
        out = {"world_size": world, "stage": rank, "cases": []}
        for p, m in pipelines(world):
            if rank >= p:
                continue
            answer = one_f_one_b(rank, p, m)
            try:
                answer = [[str(kind), int(mb)] for kind, mb in answer]
            except (TypeError, ValueError):
                return {**out, "returned": repr(answer)[:80]}
            out["cases"].append({"p": p, "m": m, "torch": torch_order(rank, p, m, groups[p]), "answer": answer})
        return out

    run_task(rank, task)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    end_rank(main())
