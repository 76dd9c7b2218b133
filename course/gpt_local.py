"""One training step of a tiny GPT on DP x TP ranks with real numbers, against the same step in one process.

Run it from any directory, in a terminal (after `pip install -e .`, which `make setup` does):

    python course/gpt_local.py --simulate 16 --tp 4           # 16 ranks simulated in this process: DP 4 x TP 4
    torchrun --nproc-per-node 4 course/gpt_local.py --tp 2    # 4 real ranks on gloo: DP 2 x TP 2

Every rank builds the same GPT (helpers.rank.gpt, seeded), splits it Megatron-style over its TP group with sequence
parallelism (course/gpt_tp.py --sp's plan), takes its DP group's slice of one batch, runs forward and backward, and
averages the gradients over its DP group. Then the whole batch goes through one unsplit process, in fp32 and in fp64:
the fp32 process's distance from fp64 is the noise floor of this step, and every rank's gradients must come as close
to fp64 as a few times that floor. With --simulate N the N ranks are torch's LocalTensor (helpers.rank.local_ranks):
one process holds each rank's tensors and runs every collective as the equal operation on them, so a layout of 64
ranks runs on a laptop with every number real. Prints one JSON line (rank 0's view, every rank's worst error).
"""
import argparse
import contextlib
import copy
import json

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from helpers.rank.gpt import GPT, GPTConfig
from helpers.rank.metrics import Reporter
from helpers.rank.local_ranks import LocalTensorMode, average_gradients, per_rank, rank_map, tensor_parallel
from helpers.rank.runtime import end_rank, launched_ranks, log0


CFG = GPTConfig(vocab_size=64, seq_len=32, n_layer=2, n_head=8, d_model=64)  # heads and positions split over 1-8


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--simulate", type=int, default=0, help="simulate this many ranks in one process (0: torchrun's)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree; dp = ranks / tp")
    p.add_argument("--per-dp", type=int, default=2, help="sequences per DP rank")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def problem(world: int, tp: int, cfg: GPTConfig) -> str | None:
    if world < 1 or tp < 1 or world % tp:
        return f"--tp {tp} does not divide the {world} ranks"
    if cfg.n_head % tp or cfg.seq_len % tp:
        return f"--tp {tp} does not divide the {cfg.n_head} heads and the {cfg.seq_len} positions"
    return None


def one_process(model, x, y) -> tuple[float, dict]:
    _, loss = model(x, y)
    loss.backward()
    return loss.item(), {n: p.grad.detach() for n, p in model.named_parameters()}


def step(args, world: int, cfg: GPTConfig = CFG) -> dict:
    dp = world // args.tp
    torch.manual_seed(args.seed)
    model = GPT(cfg)
    x, y = (torch.randint(0, cfg.vocab_size, (dp * args.per_dp, cfg.seq_len)) for _ in range(2))
    loss32, grads32 = one_process(copy.deepcopy(model), x, y)
    _, grads64 = one_process(copy.deepcopy(model).double(), x, y)
    floor = max((grads32[n].double() - grads64[n]).abs().max().item() for n in grads64)
    with LocalTensorMode(world) if args.simulate else contextlib.nullcontext():
        mesh = init_device_mesh("cpu", (dp, args.tp), mesh_dim_names=("dp", "tp"))
        tensor_parallel(model, mesh["tp"])
        part = lambda t: rank_map(lambda r: t[r // args.tp * args.per_dp:(r // args.tp + 1) * args.per_dp])  # noqa
        _, loss = model(part(x), part(y))
        loss.backward()
        average_gradients(model, mesh["dp"].get_group(), dp)
        dist.all_reduce(loss := loss.detach(), group=mesh["dp"].get_group())
        losses = {r: v.item() / dp for r, v in per_rank(loss).items()}
        error = {}
        for name, p in model.named_parameters():
            for r, g in per_rank(p.grad).items():
                error[r] = max(error.get(r, 0.0), (g.double() - grads64[name]).abs().max().item())
    if not args.simulate:  # every real rank's view, to rank 0
        views = [None] * world
        dist.all_gather_object(views, (losses, error))
        losses, error = ({r: v for view in views for r, v in view[i].items()} for i in (0, 1))
    return dict(ranks=world, dp=dp, tp=args.tp, simulated=bool(args.simulate), loss=losses, loss_one_process=loss32,
                grad_error=error, floor=floor)


def main(argv=None) -> int:
    args = parse_args(argv)
    world = args.simulate or launched_ranks("torchrun --nproc-per-node 4 course/gpt_local.py --tp 2")[2]
    found = problem(world, args.tp, CFG)
    if found:
        raise SystemExit(found)
    if args.simulate:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    else:
        dist.init_process_group("gloo")
    try:
        result = step(args, world)
        rank = dist.get_rank()
    finally:
        dist.destroy_process_group()
    if not args.simulate and rank == 0:
        Reporter(schema=None).result(local_ranks=result)  # Run.result under helpers.launch (not a training run)
    log0(json.dumps(result))
    return 0


if __name__ == "__main__":
    end_rank(main())
