"""ddp_cifar10.py made fault tolerant: periodic snapshots, resume from the newest one, and a fault injector.

    torchrun --nproc-per-node 2 --max-restarts 3 course/elastic_cifar10.py --epochs 2 --snapshot-every 20
    FAULT_RANK=1 FAULT_STEP=30 torchrun --nproc-per-node 2 --max-restarts 1 course/elastic_cifar10.py

When a rank dies, torchrun (the agent) stops the others and, up to --max-restarts times, starts a new set of
processes. Nothing in memory survives, so everything needed to carry on is in the snapshot rank 0 writes every
--snapshot-every steps: weights, optimizer and LR-scheduler state, step, position in the epoch's data order,
RNG states. It is written atomically (a crash mid-write leaves the previous one intact) and on start every rank
loads the newest, so on CPU the run ends bitwise equal to one that never crashed. On a cluster --snapshot-dir
must be on a filesystem every node sees. FAULT_RANK=r FAULT_STEP=s: rank r exits abruptly after step s, once
(helpers/rank/faults.py). At the end rank 0 measures the test accuracy on --test-size images.
"""
import itertools
import os
import random
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from helpers.rank import harness
from helpers.rank.checkpoint import latest_snapshot, load_snapshot, save_atomic, save_snapshot, state_dict_sha256
from helpers.rank.devices import rank_device
from helpers.rank.faults import init_attempt_process_group, maybe_inject_fault
from helpers.rank.metrics import Reporter
from helpers.rank.models import SimpleCNN
from helpers.rank.runtime import end_rank, launched_ranks, log0


def parse_args():
    p = harness.parser("Fault-tolerant DDP training of SimpleCNN (torchrun --max-restarts K).", test_size=1000)
    p.add_argument("--out-dir", default=os.environ.get("HELPERS_RUN_DIR") or "runs/elastic_cifar10")
    p.add_argument("--snapshot-dir", default=None, help="default: <out-dir>/snapshots; shared by all nodes")
    p.add_argument("--snapshot-every", type=int, default=20, help="steps between snapshots")
    p.add_argument("--keep", type=int, default=2, help="how many snapshots to keep (the newest ones)")
    return p.parse_args()


class ResumableSampler(DistributedSampler):
    """A DistributedSampler that can start part-way into an epoch, skipping what was trained on before a crash."""
    skip = 0  # how many of this rank's indices to skip in the current epoch

    def __iter__(self):
        return itertools.islice(super().__iter__(), self.skip, None)

    def __len__(self):
        return self.num_samples - self.skip


@record  # on a crash, torchrun's error file names the rank and holds its traceback
def main():
    args = parse_args()
    args.snapshot_dir = args.snapshot_dir or os.path.join(args.out_dir, "snapshots")
    # RANK is this process's place in the whole job, LOCAL_RANK its place on this node (which GPU it drives).
    # A restart starts NEW processes (new pids, empty memory), and with elastic rendezvous (--nnodes 1:2) the
    # agents may come back in another order, so the same machine can get other RANKs and WORLD_SIZE can change.
    # So nothing is tied to a rank or a pid: the snapshot is identified by its step, every rank loads the same
    # one, and TORCHELASTIC_RESTART_COUNT says how many times the agent has restarted the workers.
    how = "torchrun --nproc-per-node 2 --max-restarts 3 course/elastic_cifar10.py"
    rank, local_rank, world_size = launched_ranks(how)
    restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (set before CUDA starts)
    device, backend = rank_device(local_rank)
    init_attempt_process_group(backend, rank, world_size, restart_count)  # the agent's store, a prefix per attempt
    try:
        train(args, rank, local_rank, world_size, device, restart_count)
    finally:
        dist.destroy_process_group()


def train(args, rank, local_rank, world_size, device, restart_count):
    rep = Reporter()
    torch.manual_seed(args.seed)
    random.seed(args.seed)  # not used here, but RNG state a real script must restore (numpy's too, if used)
    torch.use_deterministic_algorithms(True, warn_only=True)  # same inputs -> same bits, so resume can be exact

    train_ds, test_ds, info = harness.datasets(args)
    sampler = ResumableSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    # The loader gets its own generator: by default every new epoch iterator draws a seed from the global RNG,
    # and after a mid-epoch resume that draw would come at a different moment and shift the flips below.
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, generator=torch.Generator())

    model = DDP(SimpleCNN(info.num_classes).to(device), device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    total_steps = args.steps if args.steps is not None else args.epochs * len(loader)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)
    config = {k: getattr(args, k) for k in ("seed", "batch_size", "lr", "train_size", "dataset", "epochs")}

    # Resume. Rank 0 picks the snapshot and broadcasts its path, so every rank loads the same one.
    step, start_epoch, seen, resumed_from = 0, 0, 0, None
    found = [str(latest_snapshot(args.snapshot_dir) or "") if rank == 0 else None]
    dist.broadcast_object_list(found, src=0)
    if found[0]:
        snap = load_snapshot(found[0])
        if snap["config"] != config:
            raise SystemExit(f"{found[0]} is from a run with {snap['config']}, not {config}: use a new --snapshot-dir")
        model.module.load_state_dict(snap["model"])
        optimizer.load_state_dict(snap["optimizer"])
        scheduler.load_state_dict(snap["scheduler"])
        torch.set_rng_state(snap["rng"]["torch"])
        random.setstate(snap["rng"]["python"])
        resumed_from = step = snap["step"]
        start_epoch, seen = snap["epoch"], snap["seen"]
        rel = os.path.relpath(found[0])
        shown = found[0] if rel.startswith("..") else rel  # relative to the working directory when inside it
        log0(f"attempt {restart_count}: resumed from {shown} (step {step}, epoch {start_epoch})")
        rep.event("resumed", step=step, snapshot=found[0], attempt=restart_count)
    log0(f"world_size={world_size} backend={dist.get_backend()} steps={total_steps} attempt={restart_count}")
    meter = harness.Meter(total_steps, device, world_size, samples_per_step=args.batch_size * world_size,
                          skip=args.skip_steps, start=step, reporter=rep)

    for epoch in range(start_epoch, -(-total_steps // len(loader))):
        sampler.set_epoch(epoch)  # the same shuffle of this epoch as before the crash
        # `seen` counts samples of this epoch the whole job trained on; every rank skips its share of them.
        # (Exact even if WORLD_SIZE changed, as long as it divides `seen`: the shuffle is one global order.)
        sampler.skip = seen // world_size
        for images, labels in meter.batches(loader):
            flip = torch.rand(len(images)) < 0.5  # random horizontal flips: why the RNG state is in the snapshot
            images = torch.where(flip[:, None, None, None], images.flip(3), images)
            images, labels = images.to(device), labels.to(device)
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            step = meter.step(loss=loss.item(), epoch=epoch, samples=labels.size(0), attempt=restart_count)
            seen += labels.size(0) * world_size
            maybe_inject_fault(rank, step, args.snapshot_dir)
            if step % args.snapshot_every == 0:
                if rank == 0:  # the replicas are identical, so one copy is enough
                    state = {"step": step, "epoch": epoch, "seen": seen, "world_size": world_size, "config": config,
                             "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                             "scheduler": scheduler.state_dict(),
                             # every rank seeds alike and draws alike, so rank 0's RNG state is every rank's
                             # (a script that seeds per rank must save one state per rank)
                             "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}}
                    save_snapshot(state, args.snapshot_dir, step, keep=args.keep)
                    rep.event("snapshot", step=step)
                dist.barrier()  # past this line, every rank knows snapshot `step` is on disk
        seen = 0
    meter.finish()

    digest = state_dict_sha256(model.module.state_dict())  # every rank reports it: the replicas must agree bit for bit
    final = os.path.join(args.out_dir, "final_model.pt")
    if rank == 0:
        save_atomic(model.module.state_dict(), final)
    accuracy = harness.evaluate(model.module, test_ds, device)
    dist.barrier()
    log0(f"done: {step} steps, resumed from {resumed_from}, restarts {restart_count}, sha256 {digest[:16]}")
    log0(f"test accuracy {accuracy:.4f} on {len(test_ds)} images")
    rep.result(final_params_sha256=digest, steps=step, resumed_from=resumed_from, restart_count=restart_count,
               world_size=world_size, checkpoint=final, dataset=info.name, test_accuracy=accuracy)


if __name__ == "__main__":
    end_rank(main())  # exits without interpreter teardown: see helpers/rank/runtime.py
