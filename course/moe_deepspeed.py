"""DeepSpeed's MoE layer beside the course's, on the same tokens and weights, with expert parallelism over every rank.

Run it from any directory, in a terminal (after `pip install -e .`, which `make setup` does):

    torchrun --nproc-per-node 2 course/moe_deepspeed.py             # EP = 2: 8 experts, 4 on each rank
    torchrun --nproc-per-node 4 course/moe_deepspeed.py --tokens 96

DeepSpeed (`deepspeed.moe.layer.MoE`, the MoE of the framework the course started from) and the course's layer
(helpers/rank/moe.py) are built with the same router and expert weights; each rank feeds both the same tokens, runs a
forward and a backward, and compares the outputs, the load-balancing losses and the gradients:
- top-1 (Switch): the same rules (capacity ceil(factor x T / E), first come first served, the gate not rescaled,
  aux = E sum_e f_e P_e), so the same numbers, to fp32 rounding;
- top-2: DeepSpeed rescales a token's kept gates to sum to 1 and counts only first choices in its balancing loss; the
  course's layer with renormalize=True, and that loss computed from first choices, give DeepSpeed's numbers again.
The rounding floor is the course's layer in fp32 against itself in fp64.
"""
import argparse

import deepspeed
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from helpers.rank.devices import rank_device
from helpers.rank.metrics import Reporter
from helpers.rank.moe import MoE, deepspeed_moe
from helpers.rank.runtime import end_rank, launched_ranks, log0

LAUNCH_RULES = {"--experts": "experts_split_over_ep", "--top-k": "top_k_at_most_experts",
                "--capacity-factor": "capacity_factor_positive"}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--d-model", type=int, default=96)
    p.add_argument("--tokens", type=int, default=48, help="token rows per rank (one group)")
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--top-k", type=int, default=2, help="the largest k compared (DeepSpeed has top-1 and top-2)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def first_choice_aux(layer: MoE, x) -> torch.Tensor:
    """The balancing loss from first choices only: ``E sum_e f1_e P_e`` (DeepSpeed's top-2 ``l_aux``)."""
    probs = layer.router(x.reshape(-1, x.size(-1))).softmax(-1)
    f1 = torch.bincount(probs.argmax(-1), minlength=layer.n_experts).to(probs.dtype) / probs.size(0)
    return layer.n_experts * (f1 * probs.mean(0)).sum()


def compare(args, k: int, rank: int, world: int) -> dict:
    """Both layers at top-``k`` on this rank's tokens: gaps of output, loss and gradients, and the fp64 floor."""
    torch.manual_seed(args.seed)  # every rank builds the same E experts, keeps its own
    ours = MoE(args.d_model, args.experts, k, args.capacity_factor, group=dist.group.WORLD, renormalize=k == 2)
    ours.keep_local()
    theirs = deepspeed_moe(args.d_model, args.experts, top_k=k, capacity_factor=args.capacity_factor, ep=world)
    local = sorted(ours.experts, key=int)
    with torch.no_grad():
        theirs.deepspeed_moe.gate.wg.weight.copy_(ours.router.weight)
        for mine, expert in zip(local, theirs.deepspeed_moe.experts.deepspeed_experts):
            for p, q in zip(expert.parameters(), ours.experts[mine].parameters(), strict=True):
                p.copy_(q)
    gen = torch.Generator().manual_seed(args.seed + 1 + rank)
    x, target = (torch.randn(1, args.tokens, args.d_model, generator=gen) for _ in range(2))

    def step(layer, dtype, is_ds):
        layer = layer.to(dtype)
        layer.zero_grad(set_to_none=True)
        xs = x.to(dtype)
        if is_ds:
            y, aux, _counts = layer(xs)
        else:
            y = layer(xs)
            aux = first_choice_aux(layer, xs) if k == 2 else layer.aux_loss
        loss = (y * target.to(dtype)).sum() + aux
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in layer.parameters()])
        return y.detach().double(), aux.item(), grads.double()

    y_ds, aux_ds, g_ds = step(theirs, torch.float32, True)
    y, aux, g = step(ours, torch.float32, False)
    y64, aux64, g64 = step(ours, torch.float64, False)
    gap = lambda a, b: (a - b).abs().max().item()  # noqa: E731
    ours.renormalize = False  # the course's own rules (Switch / GShard: gates as the softmax gave them, all k counted)
    with torch.no_grad():
        plain = ours.to(torch.float32)(x)
    unlike = {"out_gap_own_rules": gap(plain.double(), y_ds), "aux_gap_own_rules": abs(ours.aux_loss.item() - aux_ds)}
    return {**unlike, "top_k": k, "experts_here": [int(e) for e in local], "out_gap": gap(y, y_ds), "aux_gap": abs(aux - aux_ds),
            "grad_gap": gap(g, g_ds), "out_floor": gap(y, y64), "aux_floor": abs(aux - aux64),
            "grad_floor": gap(g, g64), "out_scale": y64.abs().max().item(), "aux": aux_ds}


@record
def main():
    args = parse_args()
    rank, local_rank, world = launched_ranks("torchrun --nproc-per-node 2 course/moe_deepspeed.py")
    if args.experts % world or not 1 <= args.top_k <= 2 or args.capacity_factor <= 0:
        raise SystemExit(f"--experts {args.experts} over {world} ranks, --top-k {args.top_k} (1 or 2), "
                         f"--capacity-factor {args.capacity_factor} (> 0): E % ranks == 0 needed")
    device, backend = rank_device(local_rank)
    deepspeed.init_distributed(dist_backend=backend)
    try:
        rows = [compare(args, k, rank, world) for k in range(1, args.top_k + 1)]
        for r in rows:
            log0(f"top-{r['top_k']}: DeepSpeed vs the course's layer on rank 0: output gap {r['out_gap']:.1e} "
                 f"(fp32 floor {r['out_floor']:.1e}), aux gap {r['aux_gap']:.1e}, grad gap {r['grad_gap']:.1e} "
                 f"(floor {r['grad_floor']:.1e})")
        Reporter(schema=None).result(world_size=world, ep=world, experts=args.experts, tokens=args.tokens,
                                     capacity_factor=args.capacity_factor, deepspeed=deepspeed.__version__,
                                     compared=rows)
    finally:
        dist.destroy_process_group()  # without it a rank aborts at exit (DeepSpeed's groups)


if __name__ == "__main__":
    end_rank(main())
