"""Exercise task: the learner writes a column-parallel and a row-parallel linear layer by hand (Megatron's f and g).

    torchrun --nproc-per-node 3 helpers/rank/exercises/tp_linear.py --answer answer.py

The learner's ``column_row_linears(x, w1, w2)`` gets the same input ``x`` (batch, D_IN) and the same full weights
``w1`` (HIDDEN, D_IN) and ``w2`` (D_OUT, HIDDEN) on every rank and returns ``(y, w1_local, w2_local)``: y =
gelu(x w1^T) w2^T computed from this rank's shards only, which are leaves that require grad. The rank records its
output, the gradient of ``x`` and of each shard under one fixed loss, and the same from two ``nn.Linear`` on one
process in float32 and float64 (their gap is the rounding floor of the checker's tolerance), sliced to this rank,
and what the forward and backward communicated (each process-group call's op and elements,
:class:`helpers.rank.exercises.traffic.Traffic`): column- then row-parallel all-reduces y once forward and x's
gradient once backward, and a rank that computes the whole layer from the full weights sends nothing. Then the
answer runs once more (loaded afresh) on weights whose values OUTSIDE this rank's shards are different random numbers
on every rank: an answer that uses only its shards gives the same numbers again, and one that reads the rest of the
weights (the whole layer behind collectives of the right size) does not. Then all of it on one rank fewer (a new
process group without the last rank), where there are more than 2.
"""
import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from helpers.rank.exercises import load_answer, one_rank_fewer, run_task
from helpers.rank.exercises.traffic import Traffic
from helpers.rank.runtime import end_rank, launched_ranks

BATCH, D_IN, HIDDEN, D_OUT = 4, 6, 24, 5


def inputs(dtype):
    g = torch.Generator().manual_seed(0)
    x, w1 = torch.randn(BATCH, D_IN, generator=g), torch.randn(HIDDEN, D_IN, generator=g) / D_IN ** 0.5
    w2, target = torch.randn(D_OUT, HIDDEN, generator=g) / HIDDEN ** 0.5, torch.randn(BATCH, D_OUT, generator=g)
    return x.to(dtype), w1.to(dtype), w2.to(dtype), target.to(dtype)


def foreign(w: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    """``w`` with every value outside this rank's shard along ``dim`` replaced by random numbers of this rank's own."""
    keep = torch.zeros(w.shape[dim], dtype=torch.bool)
    keep[torch.tensor_split(torch.arange(w.shape[dim]), world)[rank]] = True
    shape = [1, 1]
    shape[dim] = -1
    noise = torch.randn(w.shape, generator=torch.Generator().manual_seed(1000 + rank), dtype=w.dtype) * w.std()
    return torch.where(keep.view(shape), w, noise)


def as_lists(y, x, w1_local, w2_local) -> dict:
    """An answer's output and the gradients of x and of its shards after the backward, as lists ([] where none)."""
    grad = lambda t: [] if t.grad is None else t.grad.flatten().tolist()  # noqa: E731
    return {"y": y.detach().flatten().tolist(), "x_grad": grad(x), "w1_grad": grad(w1_local),
            "w2_grad": grad(w2_local)}


def reference(dtype, rank: int, world: int) -> dict:
    """Two nn.Linear on one process; the weights' gradients cut to this rank's shards."""
    x, w1, w2, target = inputs(dtype)
    up, down = nn.Linear(D_IN, HIDDEN, bias=False, dtype=dtype), nn.Linear(HIDDEN, D_OUT, bias=False, dtype=dtype)
    with torch.no_grad():
        up.weight.copy_(w1), down.weight.copy_(w2)
    x.requires_grad_()
    y = down(F.gelu(up(x)))
    (y * target).sum().backward()
    rows = torch.tensor_split(torch.arange(HIDDEN), world)[rank]
    return {"y": y.flatten().tolist(), "x_grad": x.grad.flatten().tolist(),
            "w1_grad": up.weight.grad[rows].flatten().tolist(), "w2_grad": down.weight.grad[:, rows].flatten().tolist(),
            "w1_shard": w1[rows].flatten().tolist(), "w2_shard": w2[:, rows].flatten().tolist()}


def main() -> int:
    rank, _, world = launched_ranks("torchrun --nproc-per-node 3 helpers/rank/exercises/tp_linear.py --answer FILE")
    parser = argparse.ArgumentParser()
    parser.add_argument("--answer", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    column_row_linears = load_answer(args.answer, "column_row_linears")
    store = dist.distributed_c10d._get_default_store()

    def outputs(answer, x, w1, w2, target) -> dict:
        """One more call of ``answer`` and the backward of the fixed loss: y and the three gradients."""
        x = x.detach().requires_grad_()
        y, w1_local, w2_local = answer(x, w1, w2)
        (y * target).sum().backward()
        return as_lists(y, x, w1_local, w2_local)

    def one_run(world: int) -> dict:
        fields = {"world_size": world, "shapes": {"w1": [HIDDEN, D_IN], "w2": [D_OUT, HIDDEN]},
                  "fp32": reference(torch.float32, rank, world), "fp64": reference(torch.float64, rank, world)}
        x, w1, w2, target = inputs(torch.float32)
        x.requires_grad_()
        with Traffic() as forward:
            returned = column_row_linears(x, w1, w2)
        if not (isinstance(returned, tuple) and len(returned) == 3):
            return {**fields, "returned": repr(type(returned).__name__)}
        y, w1_local, w2_local = returned
        fields.update(w1_local_shape=list(w1_local.shape), w2_local_shape=list(w2_local.shape),
                      leaves=bool(w1_local.is_leaf and w2_local.is_leaf and w1_local.requires_grad
                                  and w2_local.requires_grad))
        with Traffic() as backward:
            (y * target).sum().backward()
        fields["comm"] = {phase: [list(call) for call in t.calls] + ([["unseen", t.unseen, 0]] if t.unseen else [])
                          for phase, t in (("forward", forward), ("backward", backward))}
        fields["comm"]["sizes"] = {"y": BATCH * D_OUT, "x_grad": BATCH * D_IN}
        fields["answer"] = {**as_lists(y, x, w1_local, w2_local), "w1_shard": w1_local.detach().flatten().tolist(),
                            "w2_shard": w2_local.detach().flatten().tolist()}
        fields["probe"] = outputs(load_answer(args.answer, "column_row_linears"), x, foreign(w1, 0, rank, world),
                                  foreign(w2, 1, rank, world), target)
        return fields

    def task():
        runs = [one_run(world)]
        if world > 2 and one_rank_fewer(rank, world, store):  # shards cut for one rank count fail the other
            runs.append(one_run(world - 1))
        return {"world_size": world, "runs": runs}

    run_task(rank, task)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    end_rank(main())
