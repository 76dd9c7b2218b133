"""Train the course's small GPT with mixture-of-experts feed-forward blocks and expert parallelism, a process per rank.

Run it from any directory, in a terminal (after `pip install -e .`, which `make setup` does):

    torchrun --nproc-per-node 4 course/gpt_moe.py                        # EP = 4: 8 experts, 2 on each rank
    torchrun --nproc-per-node 4 course/gpt_moe.py --top-k 1              # Switch routing: one expert per token
    torchrun --nproc-per-node 4 course/gpt_moe.py --capacity-factor 0.5  # experts full: tokens dropped
    torchrun --nproc-per-node 4 course/gpt_moe.py --dp 2                 # 2-D: 2 replicas of EP 2

This is course/gpt_train.py with every block's MLP replaced by E experts and a router (helpers/rank/moe.py): each
token goes to its top-k experts, at most capacity tokens per expert (the rest skip the block: their residual carries
them). Every rank trains on its own data, like DDP; the attention, embeddings and routers are replicated, but each EP
rank holds only E / ep experts: the tokens travel to their experts and back with all-to-alls. So the dense gradients
are averaged over every rank, the expert gradients only over the dp replicas of the same experts. Before training,
one step is compared with one process holding every expert (fp32 and fp64: the noise floor).
"""
import itertools

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from helpers.calc import moe as moe_calc
from helpers.calc.mesh import script_problem
from helpers.rank import harness, lm, moe
from helpers.rank.devices import rank_device
from helpers.rank.models import count_parameters
from helpers.rank.runtime import end_rank, launched_ranks, log0

# checked by helpers.launch before any rank starts (and by main() below when started from a terminal)
LAUNCH_RULES = {"--ep": "divides_world_size", "--dp": "ep_dp_tile_world", "--experts": "experts_split_over_ep",
                "--top-k": "top_k_at_most_experts", "--capacity-factor": "capacity_factor_positive"}
LAUNCH_DEFAULTS = {"--experts": "8", "--top-k": "2", "--capacity-factor": "1.25", "--aux-weight": "0.01",
                   "--d-model": "96", "--seq-len": "48"}


def parse_args():
    p = lm.parser("Mixture-of-experts training of a small GPT with expert parallelism (launch with torchrun).")
    p.set_defaults(**{f[2:].replace("-", "_"): (float if "." in v else int)(v) for f, v in LAUNCH_DEFAULTS.items()})
    p.add_argument("--experts", type=int, help="experts per MoE layer (E)")
    p.add_argument("--top-k", type=int, help="experts each token goes to")
    p.add_argument("--capacity-factor", type=float, help="expert capacity = ceil(factor x tokens x k / E)")
    p.add_argument("--aux-weight", type=float, help="weight of the load-balancing loss")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel degree (default: every rank / --dp)")
    p.add_argument("--dp", type=int, default=None, help="data-parallel replicas of the experts (default: 1)")
    return p.parse_args()


@record
def main():
    args = parse_args()
    rank, local_rank, world_size = launched_ranks("torchrun --nproc-per-node 4 course/gpt_moe.py")
    given = {"--ep": args.ep, "--dp": args.dp, "--experts": args.experts, "--top-k": args.top_k,
             "--capacity-factor": args.capacity_factor}
    problem = script_problem(LAUNCH_RULES, {f: str(v) for f, v in given.items() if v is not None}, world_size)
    if problem:
        raise SystemExit(problem)
    args.ep = args.ep or world_size // (args.dp or 1)
    device, backend = rank_device(local_rank)
    dist.init_process_group(backend)
    try:
        train(args, world_size, device)
    finally:
        dist.destroy_process_group()


def sync_grads(model, dp_group, world_size: int) -> None:
    """Average the gradients over the global batch: dense ones over every rank, an expert's over the ranks that hold
    it (its dp replicas; the EP ranks' tokens already reached it through the all-to-all's backward)."""
    for expert, group in ((False, None), (True, dp_group)):
        grads = [p.grad for n, p in model.named_parameters() if moe.is_expert(n) == expert]
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat, group=group)
        torch.nn.utils.vector_to_parameters(flat / world_size, grads)


def train(args, world_size, device):
    mesh = init_device_mesh(device.type, (world_size // args.ep, args.ep), mesh_dim_names=("dp", "ep"))
    dp, dp_rank, ep_rank = mesh["dp"].size(), mesh["dp"].get_local_rank(), mesh["ep"].get_local_rank()
    ep_group, dp_group, rank = mesh.get_group("ep"), mesh.get_group("dp"), dist.get_rank()
    train_ds, test_ds, info = lm.datasets(args)
    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed,
                                 drop_last=True)  # every rank its own data: EP ranks route different tokens
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    moe_args = (args.experts, args.top_k, args.capacity_factor, args.seed)
    model = moe.moeify(lm.build_gpt(args, info.vocab_size).to(device), *moe_args, group=ep_group)
    params = count_parameters(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

    def step_loss(x, y):
        loss = moe.loss_of(model, x, y, args.aux_weight)
        loss.backward()
        sync_grads(model, dp_group, world_size)
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # the step's loss over the global batch: what one process would print
        return mean.item() / world_size

    held = sorted(int(e) for e in model.blocks[0].mlp.experts)
    log0(f"world_size={world_size} mesh=(dp={dp}, ep={args.ep}) experts={args.experts} top_k={args.top_k} "
         f"capacity_factor={args.capacity_factor} params on rank 0={params} gpt={model.cfg.as_dict()} "
         f"global_batch={args.batch_size * world_size}")
    xs, ys = (torch.stack(t).to(device) for t in zip(*(train_ds[i] for i in range(args.batch_size * world_size))))
    mine = slice(rank * args.batch_size, (rank + 1) * args.batch_size)
    probe_loss = step_loss(xs[mine], ys[mine])
    names = [n for n, _ in model.named_parameters()]
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    grad_norms = moe.grad_norms(model)  # after the sync: dense equal everywhere, an expert's on its dp replicas
    one = moe.moeify(lm.build_gpt(args, info.vocab_size).to(device), *moe_args, groups=world_size)  # all experts
    refs = {dt: moe.reference_step(one, xs, ys, args.aux_weight, dt, names) for dt in (torch.float32, torch.float64)}
    parity = moe.parity_check(probe_loss, grads, refs, next(model.parameters()).dtype)
    del one
    optimizer.zero_grad(set_to_none=True)
    moe.STATS.reset()  # count the training steps only

    meter = harness.Meter(args.steps, device, world_size, samples_per_step=args.batch_size * world_size,
                          skip=args.skip_steps)
    for epoch in itertools.count():
        if meter.done >= args.steps:
            break
        sampler.set_epoch(epoch)
        for x, y in meter.batches(loader):
            optimizer.zero_grad(set_to_none=True)
            loss = step_loss(x.to(device), y.to(device))
            optimizer.step()
            meter.step(loss=loss, epoch=epoch, samples=x.size(0))
    run = meter.finish()

    per_step, e = moe.STATS.per_step(meter.done), next(model.parameters()).element_size()
    formula = moe_calc.measured_bytes_per_layer(per_step["rows"]["sent"], per_step["rows"]["received"],
                                                args.d_model, e)  # rows summed over the layers already
    uniform = {x: {p: args.n_layer * v for p, v in d.items()} for x, d in moe_calc.uniform_bytes_per_layer(
        args.batch_size * args.seq_len, args.top_k, args.d_model, args.ep, e).items()}
    counts = moe_calc.parameters(count_parameters(model) - sum(p.numel() for n, p in model.named_parameters()
                                                               if ".mlp." in n), args.n_layer, args.d_model,
                                 args.experts, args.top_k, args.ep)
    test_loss = lm.evaluate(model, test_ds, device, split=False)  # every rank every window: the all-to-alls pair up
    sent = per_step["sent_bytes"]
    log0(f"test loss {test_loss:.3f} nats/char (unigram baseline {info.unigram_loss:.3f}) | "
         f"{run['train_seconds']:.1f} s training | {meter.throughput_line()}")
    log0(f"parity vs one process: loss gap {parity['loss_gap']:.2e} (bound {parity['loss_bound']:.2e}), grad gap "
         f"{parity['grad_gap']:.2e} (bound {parity['grad_bound']:.2e}) ok={parity['ok']} | bytes sent per step, "
         f"rank 0: dispatch {sent['dispatch']['forward']:.0f} (formula {formula['dispatch']['forward']:.0f}, uniform "
         f"{uniform['dispatch']['forward']:.0f}), dropped {per_step['dropped']:.1f} of "
         f"{args.batch_size * args.seq_len * args.top_k * args.n_layer} assignments")
    meter.rep.result(dp_rank=dp_rank, moe_ep_rank=ep_rank, moe_local_experts=held, moe_per_step=per_step,
                     moe_formula=formula, moe_uniform=uniform, moe_params=counts, moe_parity=parity,
                     moe_grad_norms=grad_norms)  # every rank
    meter.report(framework="moe", test_loss=test_loss, unigram_loss=info.unigram_loss, vocab_size=info.vocab_size,
                 dataset=info.name, params=params, global_batch=args.batch_size * world_size, gpt=model.cfg.as_dict(),
                 dtype=args.dtype, moe_ep_degree=args.ep, dp_degree=dp, moe_experts=args.experts,
                 moe_top_k=args.top_k, moe_capacity_factor=args.capacity_factor, moe_aux_weight=args.aux_weight)


if __name__ == "__main__":
    end_rank(main())
