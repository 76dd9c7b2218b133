"""Where a GPT's memory goes, measured: activations at several sizes, checkpointing's saving and cost, meta init.

Run it from any directory, in a terminal (after `pip install -e .`, which `make setup` does):

    torchrun --nproc-per-node 1 course/gpt_memory.py --sizes 64x8x64 128x8x64 --attentions math sdpa
    torchrun --nproc-per-node 1 course/gpt_memory.py --n-layer 4 --repeats 20

Memory is measured with PyTorch's own tracker, `torch.distributed._tools.mem_tracker.MemTracker`: it labels every
tensor alive on the device as a parameter, gradient, optimizer state, activation (saved for backward) or temporary.
For each `--sizes` entry (sequence length x batch x width) the script reads what the activations hold right after
the forward, the most they ever hold; then it trains one model per checkpointing mode (none, selective, full),
the modes interleaved step by step so that load drift hits all three alike, and times every step; then the peak of
one training step, split by kind; then it builds the GPT on the meta device and materialises it. Every rank
measures its own model (no process group traffic): activation memory per rank does not depend on how many
data-parallel ranks there are, so one rank is the lesson. Results: helpers/calc/activations.py has the formula.
"""
import argparse

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
from torch.distributed.elastic.multiprocessing.errors import record

from helpers.rank import harness, lm
from helpers.rank.devices import rank_device
from helpers.rank.gpt import CHECKPOINTS, GPT
from helpers.rank.runtime import end_rank, launched_ranks, log0


def parse_args():
    p = lm.parser("Measure where a small GPT's memory goes (launch with torchrun).", steps=10)
    p.add_argument("--sizes", nargs="+", default=["64x8x64"], help="shapes to measure: SEQxBATCHxWIDTH")
    p.add_argument("--attentions", nargs="+", default=["math"], choices=["math", "sdpa"])
    p.add_argument("--repeats", type=int, default=None, help="timed steps per checkpointing mode (default --steps)")
    return p.parse_args()


def shaped(args, seq_len: int, batch: int, d_model: int, **changes) -> argparse.Namespace:
    return argparse.Namespace(**dict(vars(args), seq_len=seq_len, batch_size=batch, d_model=d_model, **changes))


def tokens(args, vocab_size: int, device):
    """Random token ids: how much memory a step takes does not depend on which characters they are."""
    g = torch.Generator().manual_seed(args.seed)
    x, y = (torch.randint(vocab_size, (args.batch_size, args.seq_len), generator=g) for _ in range(2))
    return x.to(device), y.to(device)


def held_by_kind(snapshot, device) -> dict:
    by_kind = snapshot[device]
    return {kind.name.lower(): by_kind[kind] for kind in _MemRefType}


def activations_after_forward(model, x, y, device) -> tuple[int, int | None]:
    """Bytes autograd keeps for backward when the forward has just returned (one forward + backward), by MemTracker,
    and on a GPU also by the CUDA allocator (what the forward added to torch.cuda.memory_allocated)."""
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
        _, loss = model(x, y)
        allocated = torch.cuda.memory_allocated(device) - before if before is not None else None
        held = held_by_kind(tracker.get_tracker_snapshot("current"), device)["act"]
        loss.backward()
    model.zero_grad(set_to_none=True)
    return held, allocated


def step_peak(model, optimizer, x, y, device) -> tuple[dict, str]:
    """MemTracker's peak of one training step (forward, backward, AdamW step), by kind, and the phase it fell in:
    the first whose running peak (the most held so far) reached the step's."""
    tracker, so_far = MemTracker(), {}
    tracker.track_external(model, optimizer)
    with tracker:
        _, loss = model(x, y)
        so_far["forward"] = sum(held_by_kind(tracker.get_tracker_snapshot("peak"), device).values())
        loss.backward()
        so_far["backward"] = sum(held_by_kind(tracker.get_tracker_snapshot("peak"), device).values())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    peak = held_by_kind(tracker.get_tracker_snapshot("peak"), device)
    return peak, next((phase for phase, b in so_far.items() if b >= sum(peak.values())), "optimizer step")


def meta_init_matches(args, vocab_size: int, device) -> bool:
    with torch.device("meta"):  # shapes only: no storage allocated, no random numbers drawn
        model = GPT(lm.gpt_config(args, vocab_size))
    model.to_empty(device=device)  # storage where the model belongs, uninitialised
    model.init_weights(args.seed)  # every parameter from the seed, in a fixed order
    built = lm.build_gpt(args, vocab_size).to(device)
    return all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), built.state_dict().values()))


@record
def main():
    args = parse_args()
    rank, local_rank, world_size = launched_ranks("torchrun --nproc-per-node 1 course/gpt_memory.py")
    device, backend = rank_device(local_rank)
    dist.init_process_group(backend)
    try:
        measure(args, world_size, device)
    finally:
        dist.destroy_process_group()


def measure(args, world_size, device):
    _, _, info = lm.datasets(args)  # the text's vocabulary sets the head's size
    vocab = info.vocab_size
    sizes = []
    for size in args.sizes:
        seq_len, batch, d_model = (int(n) for n in size.split("x"))
        for attention in args.attentions:
            a = shaped(args, seq_len, batch, d_model, attention=attention)
            model = lm.build_gpt(a, vocab).to(device)
            held, allocated = activations_after_forward(model, *tokens(a, vocab, device), device)
            sizes.append(dict(seq_len=seq_len, batch=batch, d_model=d_model, n_head=args.n_head,
                              n_layer=args.n_layer, vocab=vocab, attention=attention, dtype=args.dtype,
                              checkpoint="none", act_bytes=held, **({} if allocated is None else
                                                                    {"cuda_act_bytes": allocated})))
            log0(f"s={seq_len} b={batch} h={d_model} {attention}: {held / 2**20:.2f} MiB of activations")

    x, y = tokens(args, vocab, device)
    models = {mode: lm.build_gpt(shaped(args, args.seq_len, args.batch_size, args.d_model, checkpoint=mode),
                                 vocab).to(device) for mode in CHECKPOINTS}
    held = {mode: activations_after_forward(m, x, y, device)[0] for mode, m in models.items()}
    optimizers = {mode: torch.optim.AdamW(m.parameters(), lr=args.lr) for mode, m in models.items()}
    repeats = args.repeats or args.steps
    meter = harness.Meter(repeats * len(CHECKPOINTS), device, world_size, samples_per_step=args.batch_size,
                          skip=len(CHECKPOINTS) * min(args.skip_steps, repeats - 1), log_every=10 ** 9)
    for step in meter.steps():  # none, selective, full, none, ...: the modes interleaved
        mode = CHECKPOINTS[(step - 1) % len(CHECKPOINTS)]
        _, loss = models[mode](x, y)
        loss.backward()  # "selective" and "full" run parts of the forward again here
        optimizers[mode].step()
        optimizers[mode].zero_grad(set_to_none=True)
        meter.step(loss=loss.item(), samples=args.batch_size, checkpoint_mode=mode)
    meter.finish()
    checkpointing = {mode: {"act_bytes": held[mode],
                            "step_s": meter.step_s[i::len(CHECKPOINTS)][min(args.skip_steps, repeats - 1):]}
                     for i, mode in enumerate(CHECKPOINTS)}
    for mode, c in checkpointing.items():
        log0(f"checkpoint={mode}: {c['act_bytes'] / 2**20:.2f} MiB of activations, "
             f"median step {sorted(c['step_s'])[len(c['step_s']) // 2] * 1e3:.1f} ms")

    peak, peak_phase = step_peak(models["none"], optimizers["none"], x, y, device)  # AdamW's state exists by now
    meta_ok = meta_init_matches(args, vocab, device)
    log0(f"peak of one step: {sum(peak.values()) / 2**20:.2f} MiB, in the {peak_phase}; "
         f"meta-device init equals a normal build: {meta_ok}")
    meter.report(framework="single", activations=sizes, checkpointing=checkpointing, peak_split=peak,
                 peak_phase=peak_phase, meta_init_equal=meta_ok, vocab_size=vocab, dataset=info.name, dtype=args.dtype,
                 params=sum(p.numel() for p in models["none"].parameters()), gpt=models["none"].cfg.as_dict())


if __name__ == "__main__":
    end_rank(main())
