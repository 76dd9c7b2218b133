"""Train the course's small GPT on text with tensor parallelism (Megatron-style), one process per rank.

Run it from any directory, in a terminal (after `pip install -e .`, which `make setup` does):

    torchrun --nproc-per-node 4 course/gpt_tp.py                  # TP = 4: every layer split over 4 ranks
    torchrun --nproc-per-node 2 course/gpt_tp.py --sp             # + sequence parallelism for the LayerNorms
    torchrun --nproc-per-node 4 course/gpt_tp.py --tp 2           # 2-D: FSDP2 over 2 data ranks x TP 2

This is course/gpt_train.py with DDP replaced by tensor parallelism (Megatron's plan): q/k/v and the MLP's up
projection split by output features (column-parallel: each rank holds whole heads), the attention's output projection
and the MLP's down projection by input features (row-parallel): each layer all-reduces its activations twice in
forward and twice in backward. Every TP rank trains on the SAME batch. Embeddings and head stay replicated (a few
dozen characters: nothing worth splitting). --sp shards the LayerNorm regions along the sequence (torchtitan's llama
plan). With --tp below the ranks, FSDP2 shards over the "dp" dimension of a (dp, tp) mesh.
"""
import itertools

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from helpers.calc.mesh import script_problem
from helpers.rank import harness, lm
from helpers.rank.devices import rank_device
from helpers.rank.models import count_parameters
from helpers.rank.pipeline import saved_bytes_by_module
from helpers.rank.runtime import end_rank, launched_ranks, log0

# checked by helpers.launch before any rank starts (and by main() below when started from a terminal)
LAUNCH_RULES = {"--tp": "divides_world_size", "--n-head": "heads_split_over_tp", "--seq-len": "sequence_splits_over_tp"}
LAUNCH_DEFAULTS = {"--n-head": "12", "--d-model": "96", "--seq-len": "48"}  # 12 heads split over TP 1, 2, 3, 4, 6


def parse_args():
    p = lm.parser("Tensor-parallel training of a small GPT on text (launch with torchrun).")
    p.set_defaults(**{flag[2:].replace("-", "_"): int(v) for flag, v in LAUNCH_DEFAULTS.items()})
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel degree (default: every rank)")
    p.add_argument("--sp", action="store_true", help="sequence parallelism for the LayerNorm regions")
    return p.parse_args()


@record
def main():
    args = parse_args()
    rank, local_rank, world_size = launched_ranks("torchrun --nproc-per-node 2 course/gpt_tp.py")
    given = {"--tp": args.tp, "--n-head": args.n_head, "--seq-len": args.seq_len, "--sp": "" if args.sp else None}
    problem = script_problem(LAUNCH_RULES, {f: str(v) for f, v in given.items() if v is not None}, world_size)
    if problem:
        raise SystemExit(problem)
    args.tp = args.tp or world_size
    device, backend = rank_device(local_rank)
    dist.init_process_group(backend)
    try:
        train(args, world_size, device)
    finally:
        dist.destroy_process_group()


def block_plan(sp: bool) -> dict:
    """Megatron's split of one Block. Under SP the residual stream between the regions is sequence-sharded."""
    between = Shard(1) if sp else Replicate()  # dim 1 of (batch, seq, d_model): the sequence
    # PrepareModuleInput hands q, k and v ONE replicated input, so backward all-reduces its gradient once (f)
    plan = {"attn": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
            "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.proj": RowwiseParallel(output_layouts=between),  # partial sums all-reduced (SP: reduce-scattered)
            "mlp": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
            "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel(output_layouts=between)}
    if sp:
        plan.update({"ln1": SequenceParallel(), "ln2": SequenceParallel()})  # each rank: its s / tp positions
    return plan


def edge_plan() -> dict:
    """SP only: the replicated embeddings' output is cut to this rank's positions, gathered again for the head."""
    return {"blocks.0": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                           use_local_output=True),
            "ln_f": SequenceParallel(),
            "head": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                       use_local_output=True)}


def sync_partial_grads(model) -> None:
    """SP: a LayerNorm saw s / tp positions, so its weight and bias gradients are partial sums: all-reduce each once."""
    for p in model.parameters():
        if isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements):
            p.grad = p.grad.redistribute(placements=[Replicate()] * p.grad.device_mesh.ndim)


def count_comms(model, x, y) -> tuple[dict, list]:
    """One forward and backward under CommDebugMode, no update: each phase's collectives, each block's saved bytes."""
    with CommDebugMode() as forward:
        (_, loss), saved = saved_bytes_by_module(lambda: model(x, y), dict(enumerate(model.blocks)))
    with CommDebugMode() as backward:
        loss.backward()
    with CommDebugMode() as grad_sync:
        sync_partial_grads(model)
    model.zero_grad(set_to_none=True)
    return {phase: {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()}
            for phase, mode in (("forward", forward), ("backward", backward), ("grad_sync", grad_sync))}, list(saved.values())


def train(args, world_size, device):
    mesh = init_device_mesh(device.type, (world_size // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    dp, dp_rank, tp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    train_ds, test_ds, info = lm.datasets(args)
    sampler = DistributedSampler(train_ds, num_replicas=dp, rank=dp_rank, shuffle=True, seed=args.seed,
                                 drop_last=True)  # one data shard per dp rank: the TP ranks of a group share it
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    model = lm.build_gpt(args, info.vocab_size).to(device)  # the same weights on every rank (seeded)
    params = count_parameters(model)
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], block_plan(args.sp))  # each rank keeps its 1/tp of the weights
    if args.sp:
        parallelize_module(model, mesh["tp"], edge_plan())
    if dp > 1:  # 2-D: FSDP2 shards the TP shards once more over the data-parallel ranks
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    log0(f"world_size={world_size} mesh=(dp={dp}, tp={args.tp}) sp={args.sp} params={params} "
         f"debug={dist.get_debug_level().name} "
         f"gpt={model.cfg.as_dict()} global_batch={args.batch_size * dp} sequences of {args.seq_len}")
    shards = {n: list(p.to_local().shape if isinstance(p, DTensor) else p.shape) for n, p in model.named_parameters()}
    xs, ys = zip(*(train_ds[i] for i in range(args.batch_size)))
    comms, saved = count_comms(model, torch.stack(xs).to(device), torch.stack(ys).to(device))

    meter = harness.Meter(args.steps, device, world_size, samples_per_step=args.batch_size * dp,
                          skip=args.skip_steps)
    for epoch in itertools.count():
        if meter.done >= args.steps:
            break
        sampler.set_epoch(epoch)
        for x, y in meter.batches(loader):
            x, y = x.to(device), y.to(device)
            _, loss = model(x, y)  # every TP rank: the same sequences, its own heads and hidden units
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # each rank gets the gradient of its own shards (and FSDP2 averages over dp)
            sync_partial_grads(model)  # SP's LayerNorm gradients; nothing to do without --sp
            optimizer.step()  # AdamW on the local shards only
            meter.step(loss=loss.item(), epoch=epoch, samples=x.size(0))
    run = meter.finish()

    test_loss = lm.evaluate(model, test_ds, device, split=False)  # every forward needs every TP rank
    log0(f"test loss {test_loss:.3f} nats/char (unigram baseline {info.unigram_loss:.3f}) | "
         f"{run['train_seconds']:.1f} s training | {meter.throughput_line()}")
    meter.rep.result(dp_rank=dp_rank, tp_rank=tp_rank, shard_shapes=shards, tp_comm_calls=comms,
                     tp_saved_bytes=saved)  # every rank
    meter.report(framework="tp", test_loss=test_loss, unigram_loss=info.unigram_loss, vocab_size=info.vocab_size,
                 dataset=info.name, params=params, global_batch=args.batch_size * dp, gpt=model.cfg.as_dict(),
                 dtype=args.dtype, tp_degree=args.tp, dp_degree=dp, sequence_parallel=args.sp)


if __name__ == "__main__":
    end_rank(main())
