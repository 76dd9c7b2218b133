"""Train the course's small GPT with pipeline parallelism (torch.distributed.pipelining), one process per rank.

Run it from any directory, in a terminal (after `pip install -e .`, which `make setup` does):

    torchrun --nproc-per-node 2 course/gpt_pp.py                          # 2 stages, 1F1B, 4 micro-batches
    torchrun --nproc-per-node 4 course/gpt_pp.py --schedule gpipe --microbatches 8
    torchrun --nproc-per-node 2 course/gpt_pp.py --schedule zbv          # 2 stages per rank, V-shaped
    torchrun --nproc-per-node 1 course/gpt_pp.py                          # the one-process reference: no pipeline

    torchrun --nproc-per-node 2 course/gpt_pp.py --schedule gpipe 1f1b --fp64-twin   # 4 runs, one start-up

--fp64-twin trains the same run again in fp64 afterwards (same seed, same batches) into the folder fp64 of the run
directory: the gap between the two is fp32's rounding, the floor against which two fp32 runs are compared. Several
schedules train one after another in one launch, each into the folder of its name (a start-up of the ranks takes
longer than these few steps).

The GPT is cut into balanced stages (helpers.rank.pipeline.Stage): equal numbers of transformer blocks per stage,
the embeddings on the first stage, the final LayerNorm and the head on the last (a few ten thousand parameters
beside the blocks' hundreds of thousands each). One stage per rank, two for the interleaved and V-shaped schedules.
Each step cuts the batch into --microbatches micro-batches; every rank sees the same batch: the first stage reads
the tokens, the last the targets. The loss exists only where the head is, on the last stage (rank WORLD_SIZE - 1,
rank 0 for the V shapes): that rank broadcasts the mean micro-batch loss so rank 0 can log it
(pytorch/torchtitan#547). Every forward and backward action of every micro-batch is timed on every rank (the
timeline the notebook draws).
"""
import argparse
import time

import torch
import torch.distributed as dist
import torch.distributed.pipelining as pipelining
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader

from helpers.calc.mesh import script_problem
from helpers.calc.pipeline import SCHEDULES, stage_layers, stages_of_rank
from helpers.rank import harness, lm, parts
from helpers.rank.devices import rank_device
from helpers.rank.pipeline import Stage, StageClock, lm_loss
from helpers.rank.runtime import end_rank, launched_ranks, log0

# checked by helpers.launch before any rank starts (and by main() below when started from a terminal)
LAUNCH_RULES = {"--n-layer": "layers_split_over_stages", "--microbatches": "microbatches_split_batch"}
LAUNCH_DEFAULTS = {"--n-layer": "8", "--microbatches": "4", "--batch-size": "8", "--schedule": "1f1b"}


def parse_args():
    p = lm.parser("Pipeline-parallel training of a small GPT on text (launch with torchrun).", steps=20)
    p.set_defaults(n_layer=8, d_model=64, seq_len=64, skip_steps=3)
    p.add_argument("--schedule", choices=sorted(SCHEDULES), nargs="+", default=["1f1b"],
                   help="one or more: several train one after another, each into <run dir>/<schedule>")
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per step (must divide --batch-size)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (1: ranks do not fight for cores)")
    p.add_argument("--fp64-twin", action="store_true", help="then the same run in fp64, into <run dir>/fp64")
    return p.parse_args()


@record
def main():
    args = parse_args()
    rank, local_rank, world_size = launched_ranks("torchrun --nproc-per-node 2 course/gpt_pp.py")
    schedules = list(dict.fromkeys(args.schedule))
    given = {"--n-layer": args.n_layer, "--microbatches": args.microbatches, "--batch-size": args.batch_size,
             "--schedule": " ".join(schedules)}
    problem = script_problem(LAUNCH_RULES, {f: str(v) for f, v in given.items()}, world_size)
    if problem:
        raise SystemExit(problem)
    torch.set_num_threads(args.threads)
    device, backend = rank_device(local_rank)
    dist.init_process_group(backend)
    base = parts.run_dir()
    try:
        for schedule in schedules:
            one = argparse.Namespace(**{**vars(args), "schedule": schedule})
            here = parts.enter(base, schedule) if len(schedules) > 1 else base
            train(one, rank, world_size, device)
            if args.fp64_twin:  # one start-up for both: the ranks' and torchrun's take longer than these steps
                parts.enter(here, "fp64")  # its metrics and result, read as Run.part("fp64")
                train(argparse.Namespace(**{**vars(one), "dtype": "fp64"}), rank, world_size, device)
    finally:
        dist.destroy_process_group()


def train(args, rank, world_size, device):
    train_ds, _, info = lm.datasets(args)
    order = torch.Generator().manual_seed(args.seed)  # the same batches on every rank: no DistributedSampler
    loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, generator=order, drop_last=True)
    gpt = lm.build_gpt(args, info.vocab_size).to(device)  # the same weights on every rank (seeded)
    n_stages = world_size * SCHEDULES[args.schedule][1] if world_size > 1 else 1
    layers = stage_layers(args.n_layer, n_stages)
    mine = stages_of_rank(args.schedule, rank, world_size) if world_size > 1 else [0]
    modules = [Stage(gpt, layers[s], s == 0, s == n_stages - 1) for s in mine]
    del gpt  # each rank keeps only its stages' parameters
    params = sum(p.numel() for m in modules for p in m.parameters())
    clock = StageClock()
    schedule = None
    if world_size > 1:
        stages = [clock.watch(pipelining.PipelineStage(m, s, n_stages, device)) for m, s in zip(modules, mine)]
        cls = getattr(pipelining, SCHEDULES[args.schedule][0])
        schedule = cls(stages if SCHEDULES[args.schedule][1] > 1 else stages[0], n_microbatches=args.microbatches,
                       loss_fn=clock.loss_fn(lm_loss, n_stages - 1))  # scale_grads: grads of the mean mb loss
    last_rank = next(r for r in range(world_size) if n_stages - 1 in stages_of_rank(args.schedule, r, world_size)) \
        if world_size > 1 else 0
    optimizer = torch.optim.AdamW([p for m in modules for p in m.parameters()], lr=args.lr, weight_decay=0.0)
    log0(f"world_size={world_size} schedule={args.schedule if schedule else 'none (one process)'} "
         f"stages={n_stages} ({args.n_layer // n_stages} blocks each) micro-batches={args.microbatches} "
         f"params on rank 0={params} loss on rank {last_rank}")
    meter = harness.Meter(args.steps, device, world_size, samples_per_step=args.batch_size, skip=args.skip_steps)
    batches = iter(loader)
    for step in meter.steps():
        x, y = next(batches)
        x, y = x.to(device), y.to(device)
        optimizer.zero_grad(set_to_none=True)
        dist.barrier()  # every rank starts the step together: the timeline's zero
        clock.start(step)
        if schedule is None:  # one process: the whole model, the same mean loss over the batch
            t0 = time.perf_counter()
            loss = lm_loss(modules[0](x), y)
            clock.record("F", 0, 0, t0)
            t0 = time.perf_counter()
            loss.backward()
            clock.record("B", 0, 0, t0)
        else:
            losses = [] if n_stages - 1 in mine else None
            schedule.step(*((x,) if 0 in mine else ()), target=y if losses is not None else None, losses=losses)
            loss = torch.stack(losses).mean().detach() if losses is not None else torch.zeros((), device=device)
        optimizer.step()
        loss = loss.detach().to(torch.float64)  # the loss lives on the last stage: broadcast it to every rank
        dist.broadcast(loss, src=last_rank)
        meter.step(loss=loss.item(), samples=x.size(0))
    run = meter.finish()
    log0(f"{run['train_seconds']:.1f} s training | {meter.throughput_line()}")
    if schedule is not None and rank == 0:  # the plan: the schedule's own list of actions per rank and time slot
        order = getattr(schedule, "pipeline_order", None) or schedule._get_pipeline_order()
        meter.rep.result(pp_planned={str(r): [a and str(a) for a in acts] for r, acts in order.items()})
    meter.rep.result(pp_stages=mine, pp_timeline=clock.actions, pp_saved_bytes=clock.peak_bytes())  # every rank
    meter.report(framework="pp", unigram_loss=info.unigram_loss, vocab_size=info.vocab_size, dataset=info.name,
                 params=params, global_batch=args.batch_size, gpt=lm.gpt_config(args, info.vocab_size).as_dict(),
                 dtype=args.dtype, pp_schedule=args.schedule if schedule else "none", pp_degree=world_size,
                 pp_microbatches=args.microbatches, pp_num_stages=n_stages, pp_loss_rank=last_rank)


if __name__ == "__main__":
    end_rank(main())
