"""Reference solutions of the write-the-code exercises (:mod:`helpers.notebook.exercises.write`).

A notebook never prints these by default; ``print(write.solution("ring_all_reduce"))`` shows one on request. The
tests run each of them through its checker, on real ranks, and expect it to pass.
"""
import contextlib
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils import parameters_to_vector, vector_to_parameters
from torch.utils.data import DataLoader, DistributedSampler

from helpers.rank.cp import block_softmax
from helpers.rank.moe import all_to_all_rows

__all__ = ["ring_all_reduce", "train", "train_step", "save_checkpoint", "load_checkpoint", "shard", "ds_config",
           "zero1_train", "run_blocks", "column_row_linears", "one_f_one_b", "ring_step",
           "average_gradients", "dispatch_combine"]


def ring_all_reduce(tensor):
    rank, world = dist.get_rank(), dist.get_world_size()
    chunks = list(torch.tensor_split(tensor, world))  # views into tensor; N pieces even when it is short
    right, left = (rank + 1) % world, (rank - 1) % world
    for phase in ("reduce-scatter", "all-gather"):
        for step in range(world - 1):
            send_i = (rank - step + (1 if phase == "all-gather" else 0)) % world
            recv_i = (send_i - 1) % world
            incoming = torch.empty_like(chunks[recv_i])
            reqs = [dist.isend(chunks[send_i], right), dist.irecv(incoming, left)]
            for r in reqs:
                r.wait()
            if phase == "reduce-scatter":
                chunks[recv_i] += incoming  # after N-1 steps, chunk (rank + 1) % N holds the full sum
            else:
                chunks[recv_i].copy_(incoming)
    return tensor


def train(model, dataset, epochs):
    model = DDP(model)
    sampler = DistributedSampler(dataset)
    loader = DataLoader(dataset, batch_size=4, sampler=sampler)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    return model


def shard(model):
    for block in model[:-1]:  # every block its own unit: gathered just before it runs, freed after
        fully_shard(block)
    fully_shard(model)  # the root: the last layer, which no block owns
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)  # after sharding: it must see the DTensors
    return model, optimizer


def train_step(model, optimizer, micro_batches):
    optimizer.zero_grad()
    for i, (x, y) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        # all but the last: forward AND backward inside no_sync (DDP decides in forward whether backward syncs)
        with contextlib.nullcontext() if last else model.no_sync():
            loss = nn.functional.cross_entropy(model(x), y) / len(micro_batches)  # the mean over all of them
            loss.backward()  # the last one all-reduces everything accumulated
    optimizer.step()


def save_checkpoint(path, model, optimizer, step):
    if dist.get_rank() == 0:  # the replicas are identical: one writer
        tmp = f"{path}.tmp"
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, tmp)
        os.replace(tmp, path)  # atomic: the name points at the old whole file or the new whole file


def load_checkpoint(path, model, optimizer):
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return state["step"] + 1  # the saved step is done


def ds_config():
    return {  # ZeRO-3 in bf16: everything partitioned, (2 + 2 + 12) / 2 = 8 bytes per parameter per rank
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},  # torch's AdamW: runs on CPUs
        "zero_optimization": {"stage": 3},
    }


def zero1_train(model, batches):
    rank, world = dist.get_rank(), dist.get_world_size()
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    size = -(-numel // world)  # ceil: every shard the same length, the last one ends in padding; none is dropped
    pad = world * size - numel
    flat = nn.functional.pad(parameters_to_vector(params).detach(), (0, pad))
    shard = flat[rank * size:(rank + 1) * size].clone().requires_grad_()
    optimizer = torch.optim.AdamW([shard], lr=0.01)  # Adam's two moments for 1/world of the weights only
    for x, y in batches:
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        grad = nn.functional.pad(parameters_to_vector([p.grad for p in params]), (0, pad))
        dist.all_reduce(grad)  # the sum over the ranks, as DDP's; divided next: the mean
        shard.grad = grad[rank * size:(rank + 1) * size] / world
        optimizer.step()  # this rank's shard only
        dist.all_gather_into_tensor(flat, shard.detach())  # after the step: every rank's updated shard, in order
        vector_to_parameters(flat[:numel], params)


def run_blocks(blocks, x):
    from torch.utils.checkpoint import checkpoint
    for block in blocks:
        # keep only the block's input; its activations are recomputed in backward, one block at a time
        x = checkpoint(block, x, use_reentrant=False)
    return x


def column_row_linears(x, w1, w2):
    import torch.nn.functional as F
    rank, world = dist.get_rank(), dist.get_world_size()

    class f(torch.autograd.Function):  # before the column-parallel layer
        @staticmethod
        def forward(ctx, x):
            return x  # x is the same on every rank already

        @staticmethod
        def backward(ctx, grad):
            grad = grad.clone()
            dist.all_reduce(grad)  # each rank's columns contribute to the gradient of the whole input
            return grad

    class g(torch.autograd.Function):  # after the row-parallel layer
        @staticmethod
        def forward(ctx, partial):
            total = partial.clone()
            dist.all_reduce(total)  # the row-parallel layer's partial sums, added up
            return total

        @staticmethod
        def backward(ctx, grad):
            return grad  # the gradient of y is the same on every rank

    w1_local = torch.tensor_split(w1, world, 0)[rank].clone().requires_grad_()  # output features: rows
    w2_local = torch.tensor_split(w2, world, 1)[rank].clone().requires_grad_()  # input features: columns
    y = g.apply(F.gelu(f.apply(x) @ w1_local.T) @ w2_local.T)
    return y, w1_local, w2_local


def one_f_one_b(stage, p, m):
    warm = min(p - 1 - stage, m)  # forwards before the first backward: the stages after this one fill up
    order = [("F", i) for i in range(warm)]
    for i in range(warm, m):  # steady state: one forward, then the backward of the oldest micro-batch held
        order += [("F", i), ("B", i - warm)]
    return order + [("B", i) for i in range(m - warm, m)]  # cool-down: the backwards still owed


def average_gradients(model):
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])  # one tensor: one all-reduce, one latency
    dist.all_reduce(flat)  # the sum over the ranks, in place
    flat /= dist.get_world_size()  # DDP averages
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


def ring_step(q, k, v, q_pos, k_pos, out, lse):
    if k_pos.min() > q_pos.max():  # every key after every query: no query sees this block
        return out, lse
    block_out, block_lse = block_softmax(q, k, v, q_pos, k_pos)  # this block alone
    m = torch.maximum(lse, block_lse)  # the running max: every exponent below is <= 0
    new = m + torch.log(torch.exp(lse - m) + torch.exp(block_lse - m))
    out = out * torch.exp(lse - new).unsqueeze(-1) + block_out * torch.exp(block_lse - new).unsqueeze(-1)
    return out, new


def dispatch_combine(rows, expert, n_experts, run_experts, group):
    world, me = dist.get_world_size(group), dist.get_rank(group)
    per = n_experts // world
    kept = (expert >= 0).nonzero().flatten()
    order = kept[torch.argsort(expert[kept], stable=True)]  # kept rows grouped by expert: by destination rank
    counts = torch.bincount(expert[order], minlength=n_experts)
    incoming = torch.empty_like(counts)
    dist.all_to_all_single(incoming, counts, group=group)  # [i * per + j]: rows rank i sends to my j-th expert
    send, recv = counts.view(world, per).sum(1).tolist(), incoming.view(world, per).sum(1).tolist()
    arrived = all_to_all_rows(rows[order], send, recv, group)  # differentiable: the gradients come back
    ids = torch.arange(me * per, (me + 1) * per).repeat(world).repeat_interleave(incoming)
    out = run_experts(arrived, ids)  # this rank's experts, on the rows that came
    back = all_to_all_rows(out, recv, send, group)  # the outputs go home: the splits swapped
    return torch.zeros_like(rows).index_add(0, order, back)  # token order; a dropped row stays 0
