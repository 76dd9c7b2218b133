"""Train the course's small GPT on a 3-D mesh: data x pipeline x tensor parallelism, one process per rank.

Run it from any directory, in a terminal (after `pip install -e .`, which `make setup` does):

    torchrun --nproc-per-node 8 course/gpt_3d.py                  # dp 2 x pp 2 x tp 2
    torchrun --nproc-per-node 4 course/gpt_3d.py --pp 2 --tp 1    # dp 2 x pp 2
    torchrun --nproc-per-node 1 course/gpt_3d.py --pp 1 --tp 1 --batch-size 16   # one process, the same batches

--fp64-twin trains the same run again in fp64 afterwards (same seed, same batches) into the folder fp64 of the run
directory: the gap between the two is fp32's rounding, the floor against which two fp32 runs are compared.

`init_device_mesh("cpu", (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))` gives every rank one coordinate per axis.
"pp": the GPT cut into --pp balanced stages (course/gpt_pp.py), the activations sent between the ranks of a pp
group. "tp": each stage's blocks split Megatron-style over the tp group (course/gpt_tp.py's plan). "dp": each dp
rank reads its own shard of the data (DistributedSampler over the dp ranks), and after each step the gradients are
averaged over the dp group by hand (one all-reduce per parameter: what DDP does, written out). The loss lives on the
last stage: one all-reduce over the world adds it up (tp copies x dp shards) and rank 0 logs the mean.
"""
import argparse
import itertools

import torch
import torch.distributed as dist
import torch.distributed.pipelining as pipelining
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               parallelize_module)
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from helpers.calc.mesh import script_problem
from helpers.calc.pipeline import stage_layers
from helpers.rank import harness, lm, parts
from helpers.rank.devices import rank_device
from helpers.rank.pipeline import Stage, StageClock, lm_loss, state_bytes
from helpers.rank.runtime import end_rank, launched_ranks, log0

LAUNCH_RULES = {"--tp": "divides_world_size", "--pp": "pp_tp_tile_world", "--n-head": "heads_split_over_tp",
                "--n-layer": "layers_split_over_stages", "--microbatches": "microbatches_split_batch"}
LAUNCH_DEFAULTS = {"--pp": "2", "--tp": "2", "--n-head": "4", "--n-layer": "4", "--microbatches": "2",
                   "--batch-size": "8", "--schedule": "1f1b"}


def parse_args():
    p = lm.parser("DP x PP x TP training of a small GPT on text (launch with torchrun).", steps=10)
    p.set_defaults(n_layer=4, n_head=4, d_model=32, seq_len=32, skip_steps=2)
    p.add_argument("--pp", type=int, default=2, help="pipeline stages (ranks per pp group)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (ranks per tp group)")
    p.add_argument("--schedule", choices=["gpipe", "1f1b"], default="1f1b")
    p.add_argument("--microbatches", type=int, default=2, help="micro-batches per step and dp rank")
    p.add_argument("--fp64-twin", action="store_true", help="then the same run in fp64, into <run dir>/fp64")
    return p.parse_args()


@record
def main():
    args = parse_args()
    rank, local_rank, world_size = launched_ranks("torchrun --nproc-per-node 8 course/gpt_3d.py")
    given = {"--pp": args.pp, "--tp": args.tp, "--n-head": args.n_head, "--n-layer": args.n_layer,
             "--microbatches": args.microbatches, "--batch-size": args.batch_size, "--schedule": args.schedule}
    problem = script_problem(LAUNCH_RULES, {f: str(v) for f, v in given.items()}, world_size)
    if problem:
        raise SystemExit(problem)
    torch.set_num_threads(1)
    device, backend = rank_device(local_rank)
    dist.init_process_group(backend)
    try:
        train(args, rank, world_size, device)
        if args.fp64_twin:  # one start-up for both: the ranks' and torchrun's take longer than these steps
            parts.enter(parts.run_dir(), "fp64")  # its metrics and result, read as Run.part("fp64")
            train(argparse.Namespace(**{**vars(args), "dtype": "fp64"}), rank, world_size, device)
    finally:
        dist.destroy_process_group()


def tp_plan() -> dict:
    """Megatron's split of one Block (course/gpt_tp.py without --sp): column- then row-parallel, twice."""
    one_input = dict(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),))  # q, k, v share one input
    return {"attn": PrepareModuleInput(**one_input), "mlp": PrepareModuleInput(**one_input),
            "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.proj": RowwiseParallel(), "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel()}


def train(args, rank, world_size, device):
    dp = world_size // (args.pp * args.tp)
    mesh = init_device_mesh(device.type, (dp, args.pp, args.tp), mesh_dim_names=("dp", "pp", "tp"))
    dp_rank, pp_rank, tp_rank = (mesh[d].get_local_rank() for d in ("dp", "pp", "tp"))
    train_ds, _, info = lm.datasets(args)
    sampler = DistributedSampler(train_ds, num_replicas=dp, rank=dp_rank, shuffle=True, seed=args.seed,
                                 drop_last=True)  # one data shard per dp rank: its pp and tp ranks share it
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    gpt = lm.build_gpt(args, info.vocab_size).to(device)
    blocks = stage_layers(args.n_layer, args.pp)[pp_rank]
    first, last = pp_rank == 0, pp_rank == args.pp - 1
    model = Stage(gpt, blocks, first, last)
    del gpt
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], tp_plan())  # this rank's heads and hidden units of its stage's blocks
    heads = args.n_head // args.tp
    print(f"rank {rank}: data shard {dp_rank} of {dp}, tensor shard {tp_rank} of {args.tp} (heads "
          f"{tp_rank * heads}-{(tp_rank + 1) * heads - 1}), pipeline stage {pp_rank} of {args.pp} (blocks {blocks}"
          f"{', embeddings' if first else ''}{', head + loss' if last else ''})", flush=True)
    schedule, clock, states = None, StageClock(), None  # the clock weighs the activations each micro-batch saves
    if args.pp > 1:
        stage = pipelining.PipelineStage(model, pp_rank, args.pp, device, group=mesh["pp"].get_group())
        clock.watch(stage)
        cls = pipelining.ScheduleGPipe if args.schedule == "gpipe" else pipelining.Schedule1F1B
        schedule = cls(stage, n_microbatches=args.microbatches, loss_fn=clock.loss_fn(lm_loss, args.pp - 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    log0(f"world_size={world_size} mesh=(dp={dp}, pp={args.pp}, tp={args.tp}) global_batch={args.batch_size * dp}")
    meter = harness.Meter(args.steps, device, world_size, samples_per_step=args.batch_size * dp,
                          skip=args.skip_steps)
    for epoch in itertools.count():
        if meter.done >= args.steps:
            break
        sampler.set_epoch(epoch)
        for x, y in meter.batches(loader):
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad(set_to_none=True)
            if schedule is None:
                loss = lm_loss(model(x), y)
                loss.backward()
            else:
                losses = [] if last else None
                schedule.step(*((x,) if first else ()), target=y if last else None, losses=losses)
                loss = torch.stack(losses).mean() if last else torch.zeros((), device=device)
            for p in model.parameters():  # DP by hand: average each gradient over the dp group
                local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                dist.all_reduce(local, group=mesh["dp"].get_group())
                local /= dp
            optimizer.step()
            states = states or state_bytes(model, optimizer)  # after the first step: every state exists
            total = loss.detach().to(torch.float64) * (1.0 if last else 0.0)
            dist.all_reduce(total)  # the last stage's loss, tp copies x dp shards of it: their mean below
            meter.step(loss=total.item() / (dp * args.tp), epoch=epoch, samples=x.size(0))
    run = meter.finish()
    log0(f"{run['train_seconds']:.1f} s training | {meter.throughput_line()}")
    meter.rep.result(dp_rank=dp_rank, tp_rank=tp_rank, pp_stages=[pp_rank], rank_state_bytes=states,
                     pp_saved_bytes=clock.peak_bytes())  # every rank: its role and what it held
    meter.report(framework="3d", dp_degree=dp, tp_degree=args.tp, pp_degree=args.pp, pp_schedule=args.schedule,
                 pp_microbatches=args.microbatches, global_batch=args.batch_size * dp, dtype=args.dtype,
                 gpt=lm.gpt_config(args, info.vocab_size).as_dict(), vocab_size=info.vocab_size, dataset=info.name)


if __name__ == "__main__":
    end_rank(main())
