"""Exercise task: the learner shards a model with FSDP2's ``fully_shard`` and builds its optimizer.

    torchrun --nproc-per-node 2 helpers/rank/exercises/fsdp_shard.py --answer answer.py

The learner's ``shard(model)`` returns ``(model, optimizer)``. The rank records how many bytes of parameters it holds
(a DTensor's local shard counts, a plain tensor counts whole), which modules are FSDP units, whether the optimizer
holds the model's current parameters, and the loss over a few steps on one fixed batch, next to the same steps run
by an unsharded copy in float32 and float64 (their gap is the rounding floor the checker's tolerance is built on).
"""
import argparse
import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from helpers.rank.exercises import load_answer, run_task
from helpers.rank.runtime import end_rank, launched_ranks

BLOCKS, WIDTH, STEPS, LR = 4, 32, 3, 0.05


def make_model() -> nn.Sequential:
    torch.manual_seed(0)  # the same model on every rank: fully_shard keeps each rank's slice of it
    blocks = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(BLOCKS)]
    return nn.Sequential(*blocks, nn.Linear(WIDTH, 4))


def batch():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, WIDTH, generator=g)
    return x, (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()


def losses(model, optimizer, dtype=torch.float32) -> list[float]:
    x, y = batch()
    out = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x.to(dtype)), y)
        loss.backward()
        optimizer.step()
        out.append(loss.item())
    return out


def main() -> int:
    rank, _, world = launched_ranks("torchrun --nproc-per-node 2 helpers/rank/exercises/fsdp_shard.py --answer FILE")
    parser = argparse.ArgumentParser()
    parser.add_argument("--answer", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    shard = load_answer(args.answer, "shard")

    def task():
        model = make_model()
        full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        # fully_shard splits each parameter along dim 0 into world_size pieces (the last may be padding)
        shard_bytes = sum(-(-p.shape[0] // world) * p[0].numel() * p.element_size() for p in model.parameters())
        reference = {}
        for name, dtype in (("fp32", torch.float32), ("fp64", torch.float64)):
            plain = copy.deepcopy(model).to(dtype)
            reference[name] = losses(plain, torch.optim.SGD(plain.parameters(), lr=LR), dtype)
        returned = shard(model)
        model, optimizer = returned if isinstance(returned, tuple) else (returned, None)
        params = list(model.parameters())
        local_bytes = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in params)
        in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]} if optimizer else set()
        fields = {"world_size": world, "full_bytes": full_bytes, "local_bytes": local_bytes,
                  "shard_bytes": shard_bytes,
                  "units": sum(isinstance(m, FSDPModule) for m in model.modules()),
                  "root_is_unit": isinstance(model, FSDPModule), "blocks": BLOCKS,
                  "optimizer": optimizer is not None,
                  "optimizer_has_model_params": bool(params) and in_optimizer == {id(p) for p in params},
                  "reference": reference}
        fields["losses"] = losses(model, optimizer) if optimizer is not None else []
        return fields

    run_task(rank, task)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    end_rank(main())
