"""Many ranks in one process, with real numbers: torch's LocalTensor (``torch.distributed._local_tensor``, a private
API; tests/test_local_ranks.py pins it).

Under ``LocalTensorMode(W)`` a tensor is W tensors, one per simulated rank, every operation runs on each, and a
collective on a process group runs as the mathematically equal operation on its ranks' tensors. The fake process group
(``init_process_group("fake")``) keeps the mesh's bookkeeping, so DTensor and torch's tensor parallelism run unchanged.
:func:`rank_map` gives each rank its own tensor (its slice of the batch) and is ``cb(dist.get_rank())`` on a real
rank, so the same step runs on 16-64 simulated ranks here and on real ranks under torchrun (course/gpt_local.py).

FSDP2 does not run under it in torch 2.14 (it frees each parameter's storage after use, which a LocalTensor does not
have: "Attempted to call resize_() on an invalid python storage"), so data parallelism here is DDP's rule written out:
the gradients averaged over the dp ranks after backward (notebook 01's all-reduce).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed._local_tensor import LocalTensorMode, enabled_local_tensor_mode, rank_map, tensor_map
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from .at_scale import block_plan, edge_plan

__all__ = ["LocalTensorMode", "average_gradients", "per_rank", "rank_map", "tensor_parallel"]


def tensor_parallel(model, tp_mesh) -> None:
    """The course GPT split Megatron-style over ``tp_mesh`` with sequence parallelism (course/gpt_tp.py --sp's plan),
    its embeddings and head whole, in place."""
    for block in model.blocks:
        parallelize_module(block, tp_mesh, block_plan())
    parallelize_module(model, tp_mesh, edge_plan(first=True, last=True))


def average_gradients(model, dp_group, dp: int) -> None:
    """DDP's rule: every gradient summed over the ``dp`` ranks of ``dp_group`` and divided by ``dp`` (each rank's
    local tensor of a DTensor gradient: its TP shard)."""
    for p in model.parameters():
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        dist.all_reduce(grad, group=dp_group)
        grad.div_(dp)


def per_rank(t: torch.Tensor) -> dict[int, torch.Tensor]:
    """{rank: its tensor}: every simulated rank's under LocalTensorMode, else this rank's alone."""
    if isinstance(t, DTensor):
        t = t.full_tensor()
    if enabled_local_tensor_mode() is None:
        return {dist.get_rank(): t.detach()}
    out: dict[int, torch.Tensor] = {}

    def keep(rank: int, local: torch.Tensor) -> torch.Tensor:
        out[rank] = local.detach().clone()
        return out[rank]

    tensor_map(t.detach(), keep)
    return out
