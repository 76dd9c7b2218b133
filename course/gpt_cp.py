"""Train the course's small GPT with context parallelism: each sequence split along its positions, a process per rank.

Run it from any directory, in a terminal (after `pip install -e .`, which `make setup` does):

    torchrun --nproc-per-node 4 course/gpt_cp.py                      # CP = 4: ring attention, zig-zag layout
    torchrun --nproc-per-node 4 course/gpt_cp.py --attn ulysses       # all-to-all: heads scattered, sequence gathered
    torchrun --nproc-per-node 4 course/gpt_cp.py --layout contiguous  # the causal work falls 1 : 2 : 3 : 4
    torchrun --nproc-per-node 4 course/gpt_cp.py --dp 2               # 2-D: 2 data ranks x CP 2

This is course/gpt_train.py with the sequence, not the batch, split over the ranks: each CP rank holds seq_len / cp
positions of the SAME sequences (activations per rank / cp). Everything but attention works position by position, so
only attention needs the other ranks: --attn ring passes the K/V blocks round the ring (helpers/rank/cp.py), --attn
ulysses swaps positions for heads with two all-to-alls. The weights are replicated on every rank: each CP rank
backpropagates its share of the loss, so the gradients are summed over cp, then averaged over dp (other sequences).
Before training, one step is compared with one process on the unsplit batch (fp32 and fp64: the noise floor).
"""
import itertools
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from helpers.calc import cp as cp_calc
from helpers.calc.mesh import script_problem
from helpers.rank import cp, harness, lm
from helpers.rank.devices import rank_device
from helpers.rank.models import count_parameters
from helpers.rank.runtime import end_rank, launched_ranks, log0

# checked by helpers.launch before any rank starts (and by main() below when started from a terminal)
LAUNCH_RULES = {"--cp": "divides_world_size", "--dp": "cp_dp_tile_world", "--seq-len": "sequence_splits_over_cp",
                "--n-head": "heads_split_over_cp"}
LAUNCH_DEFAULTS = {"--n-head": "12", "--d-model": "96", "--seq-len": "48", "--attn": "ring", "--layout": "zigzag"}


def parse_args():
    p = lm.parser("Context-parallel training of a small GPT on text (launch with torchrun).")
    p.set_defaults(**{f[2:].replace("-", "_"): v if f in ("--attn", "--layout") else int(v)
                      for f, v in LAUNCH_DEFAULTS.items()})
    p.add_argument("--cp", type=int, default=None, help="context-parallel degree (default: every rank / --dp)")
    p.add_argument("--dp", type=int, default=None, help="data-parallel degree (default: every rank / --cp)")
    p.add_argument("--attn", choices=["ring", "ulysses", "torch"], help="torch: torch's context_parallel (CUDA)")
    p.add_argument("--layout", choices=list(cp.LAYOUTS), help="which positions each CP rank holds")
    return p.parse_args()


@record
def main():
    args = parse_args()
    rank, local_rank, world_size = launched_ranks("torchrun --nproc-per-node 4 course/gpt_cp.py")
    given = {"--cp": args.cp, "--dp": args.dp, "--seq-len": args.seq_len, "--n-head": args.n_head,
             "--attn": args.attn, "--layout": args.layout}
    problem = script_problem(LAUNCH_RULES, {f: str(v) for f, v in given.items() if v is not None}, world_size)
    if problem:
        raise SystemExit(problem)
    args.cp = args.cp or world_size // (args.dp or 1)
    device, backend = rank_device(local_rank)
    dist.init_process_group(backend)
    try:
        train(args, world_size, device)
    finally:
        dist.destroy_process_group()


def sync_grads(model, cp_group, dp_group, dp: int) -> None:
    """Sum the gradients over cp (each rank backpropagated its own positions' share of the loss), average over dp."""
    flat = cp.flat_grads(model)
    dist.all_reduce(flat, group=cp_group)
    if dp > 1:
        dist.all_reduce(flat, group=dp_group)
        flat /= dp
    torch.nn.utils.vector_to_parameters(flat, [p.grad for p in model.parameters()])


def train(args, world_size, device):
    mesh = init_device_mesh(device.type, (world_size // args.cp, args.cp), mesh_dim_names=("dp", "cp"))
    dp, dp_rank, cp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank(), mesh["cp"].get_local_rank()
    cp_group, dp_group = mesh.get_group("cp"), mesh.get_group("dp")
    torch_cp = args.attn == "torch" and cp.torch_context_parallel(mesh["cp"], device)  # on CPU: stops, with why
    train_ds, test_ds, info = lm.datasets(args)
    sampler = DistributedSampler(train_ds, num_replicas=dp, rank=dp_rank, shuffle=True, seed=args.seed,
                                 drop_last=True)  # one data shard per dp rank: the CP ranks of a group share it
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    model = lm.build_gpt(args, info.vocab_size).to(device)  # the same weights on every rank (seeded)
    params = count_parameters(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    positions = cp.layout_indices(args.layout, args.seq_len, args.cp, cp_rank).to(device)  # of every sequence
    attend = {"ring": partial(cp.ring_attention, group=cp_group, layout=args.layout),
              "ulysses": partial(cp.ulysses_attention, group=cp_group, layout=args.layout,
                                 attention=args.attention), "torch": None}[args.attn]

    def step_loss(x, y):  # this rank's positions of the sequences x: forward, then backward of its share
        if torch_cp:  # torch shards x, y and the positions itself (load-balanced) and runs SDPA as its own ring
            loss = cp.torch_cp_backward(model, x, y, mesh["cp"])
        else:
            _, loss = cp.gpt_forward(model, x[:, positions], positions, y[:, positions], attend)
            (loss / args.cp).backward()  # the loss is the mean over all cp ranks' positions
        sync_grads(model, cp_group, dp_group, dp)
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # the step's loss over the global batch: what one process would print
        return mean.item() / world_size

    log0(f"world_size={world_size} mesh=(dp={dp}, cp={args.cp}) attn={args.attn} layout={args.layout} "
         f"params={params} gpt={model.cfg.as_dict()} global_batch={args.batch_size * dp} sequences of "
         f"{args.seq_len}, {args.seq_len // args.cp} positions per rank")
    xs, ys = (torch.stack(t).to(device) for t in zip(*(train_ds[i] for i in range(args.batch_size * dp))))
    mine = slice(dp_rank * args.batch_size, (dp_rank + 1) * args.batch_size)
    probe_loss = step_loss(xs[mine], ys[mine])
    refs = {dt: cp.reference_step(model, xs, ys, dt) for dt in (torch.float32, torch.float64)}
    parity = cp.parity_check(probe_loss, cp.flat_grads(model), refs, next(model.parameters()).dtype)
    optimizer.zero_grad(set_to_none=True)
    act_bytes = None if torch_cp else cp.forward_activation_bytes(model, lambda: cp.gpt_forward(  # ids made inside
        model, xs[mine][:, positions], positions + 0, ys[mine][:, positions], attend))
    cp.STATS.reset()  # count the training steps only

    meter = harness.Meter(args.steps, device, world_size, samples_per_step=args.batch_size * dp,
                          skip=args.skip_steps)
    for epoch in itertools.count():
        if meter.done >= args.steps:
            break
        sampler.set_epoch(epoch)
        for x, y in meter.batches(loader):
            optimizer.zero_grad(set_to_none=True)
            loss = step_loss(x.to(device), y.to(device))
            optimizer.step()  # the same update on every rank: the same gradients everywhere after the sync
            meter.step(loss=loss, epoch=epoch, samples=x.size(0))
    run = meter.finish()

    per_step = cp.STATS.per_step(meter.done)
    formula = None if torch_cp else cp_calc.rank_per_step(args.attn, args.layout, args.n_layer, args.batch_size,
                                                          args.seq_len, args.d_model, args.n_head, args.cp, cp_rank,
                                                          next(model.parameters()).element_size())
    test_loss = lm.evaluate(model, test_ds, device)  # the whole model is on every rank: plain data-parallel scoring
    log0(f"test loss {test_loss:.3f} nats/char (unigram baseline {info.unigram_loss:.3f}) | "
         f"{run['train_seconds']:.1f} s training | {meter.throughput_line()}")
    log0(f"parity vs one process: loss gap {parity['loss_gap']:.2e} (bound {parity['loss_bound']:.2e}), grad gap "
         f"{parity['grad_gap']:.2e} (bound {parity['grad_bound']:.2e}) ok={parity['ok']} | " + (
             "torch's ring: its bytes are not counted" if torch_cp else "bytes sent per step, rank 0: forward "
             f"{per_step['forward']['sent_bytes']:.0f} (formula {formula['forward']:.0f}), backward "
             f"{per_step['backward']['sent_bytes']:.0f} (formula {formula['backward']:.0f})"))
    meter.rep.result(dp_rank=dp_rank, cp_rank=cp_rank, cp_positions=positions.tolist(), cp_per_step=per_step,
                     cp_formula=formula, cp_parity=parity, cp_act_bytes=act_bytes)  # every rank
    meter.report(framework="cp", test_loss=test_loss, unigram_loss=info.unigram_loss, vocab_size=info.vocab_size,
                 dataset=info.name, params=params, global_batch=args.batch_size * dp, gpt=model.cfg.as_dict(),
                 dtype=args.dtype, cp_degree=args.cp, dp_degree=dp, cp_attention=args.attn, cp_layout=args.layout)


if __name__ == "__main__":
    end_rank(main())
