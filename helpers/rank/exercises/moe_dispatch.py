"""Exercise task: the learner's expert-parallel dispatch and combine, run on real ranks against one process.

    torchrun --nproc-per-node 3 helpers/rank/exercises/moe_dispatch.py --answer answer.py

Every rank holds N token rows (float64, in token order) and each row's expert id, drawn per rank (-1: the assignment
was over capacity and is dropped). E experts are split evenly over the W ranks; every rank knows every expert's
weights, but the ``run_experts(rows, ids)`` the task hands the learner runs only this rank's: a row whose id is
another rank's expert is counted as misrouted and gets 0, so nothing can be computed without sending the rows. The
learner's ``dispatch_combine(rows, expert, n_experts, run_experts, group)`` (``group``: the EP ranks) must return
each row's expert output in token order (0 for a dropped row), differentiably: the task backpropagates
``(out * target).sum()`` and compares the rows' gradient with one process's too. It records what the learner's lines
sent (the forward's data-moving calls), then
runs again on one rank fewer (a new process group without the last rank), where the experts split 3 and 2 ways.
"""
import argparse

import torch
import torch.distributed as dist

from helpers.rank.exercises import load_answer, one_rank_fewer, run_task
from helpers.rank.exercises.traffic import COLLECTIVES, DIST_NAMES, UNSEEN, Traffic
from helpers.rank.runtime import end_rank, launched_ranks

EXPERTS, HIDDEN, ROWS, DROPPED = 6, 8, 10, 0.2  # 6 experts split over 3 and over 2 ranks


def weights() -> torch.Tensor:
    """Every expert's weight (E, h, h), the same on every rank."""
    return torch.randn(EXPERTS, HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def inputs(rank: int, world: int):
    """This rank's rows, expert ids (-1: dropped) and the backward's target, drawn per rank and rank count."""
    g = torch.Generator().manual_seed(1000 * world + rank)
    rows = torch.randn(ROWS, HIDDEN, generator=g, dtype=torch.float64)
    expert = torch.randint(0, EXPERTS, (ROWS,), generator=g)
    expert[torch.rand(ROWS, generator=g) < DROPPED] = -1
    expert[0] = -1  # at least one dropped row on every rank
    return rows, expert, torch.randn(ROWS, HIDDEN, generator=g, dtype=torch.float64)


def expert_fn(w: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Expert ``ids[i]`` on row i: ``tanh(rows[i] @ w[ids[i]])``."""
    return torch.tanh(torch.einsum("nh,nhk->nk", rows, w[ids]))


def reference(rows, expert, target, w):
    """One process: every row through its own expert (0 for a dropped row), and the rows' gradient."""
    x = rows.clone().requires_grad_(True)
    keep = expert >= 0
    out = torch.zeros_like(x)
    out[keep] = expert_fn(w, x[keep], expert[keep])
    (out * target).sum().backward()
    return out.detach(), x.grad


def main() -> int:
    rank, _, world = launched_ranks("torchrun --nproc-per-node 3 helpers/rank/exercises/moe_dispatch.py --answer F")
    parser = argparse.ArgumentParser()
    parser.add_argument("--answer", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    dispatch_combine = load_answer(args.answer, "dispatch_combine")
    store = dist.distributed_c10d._get_default_store()
    w = weights()

    def one_run(world: int) -> dict:
        per = EXPERTS // world
        mine = range(rank * per, (rank + 1) * per)
        misrouted = [0]

        def run_experts(arrived, ids):
            ids = torch.as_tensor(ids).reshape(-1).long()
            if ids.numel() != arrived.shape[0]:
                raise ValueError(f"run_experts got {arrived.shape[0]} rows and {ids.numel()} expert ids: one id per "
                                 f"row")
            here = (ids >= mine.start) & (ids < mine.stop)
            misrouted[0] += int((~here).sum())
            out = torch.zeros_like(arrived)
            if here.any():
                out = out.index_put((here.nonzero().flatten(),), expert_fn(w, arrived[here], ids[here]))
            return out

        rows, expert, target = inputs(rank, world)
        x = rows.clone().requires_grad_(True)
        with Traffic() as traffic:
            returned = dispatch_combine(x, expert.clone(), EXPERTS, run_experts, dist.group.WORLD)
        calls = [[DIST_NAMES.get(op, op), n] for op, n, _size in traffic.calls if op in COLLECTIVES]
        fields = {"world_size": world, "experts": list(mine), "hidden": HIDDEN,
                  "calls": calls + [[UNSEEN, 0]] * bool(traffic.unseen),
                  "dropped": (expert < 0).nonzero().flatten().tolist()}
        want, want_grad = reference(rows, expert, target, w)
        fields["want"], fields["want_grad"] = want.flatten().tolist(), want_grad.flatten().tolist()
        if not isinstance(returned, torch.Tensor) or tuple(returned.shape) != tuple(rows.shape):
            dist.barrier()  # every rank reaches the end of the run before one of them leaves
            return {**fields, "returned": type(returned).__name__ if not isinstance(returned, torch.Tensor)
                    else f"a tensor of shape {tuple(returned.shape)}"}
        fields["out"] = returned.detach().double().flatten().tolist()
        fields["misrouted"] = misrouted[0]
        differentiable = returned.requires_grad
        flags = torch.tensor([int(differentiable)])
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)  # backward only if every rank's output carries a graph
        if flags.item():
            (returned * target).sum().backward()
        fields["grad"] = x.grad.flatten().tolist() if x.grad is not None else None
        fields["differentiable"] = differentiable
        return fields

    def task():
        runs = [one_run(world)]
        if world > 2 and one_rank_fewer(rank, world, store):  # an answer for one rank count only fails here
            runs.append(one_run(world - 1))
        return {"world_size": world, "runs": runs}

    run_task(rank, task)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    end_rank(main())
