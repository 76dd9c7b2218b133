"""What does each collective cost here? Five collectives timed over message sizes, for an alpha-beta model.

    torchrun --nproc-per-node 2 course/collective_sweep.py
    torchrun --nproc-per-node 4 course/collective_sweep.py --max-bytes 67108864 --iters 9
    torchrun --nproc-per-node 2 course/collective_sweep.py --trace --gaps-ms 30 --gap-ops all_reduce

For each collective and size: warm up, then time --iters calls one by one, each between two barriers, on every
rank. A rank that arrives first waits for the others inside the collective, so its time includes the others'
lateness; the last to arrive waits for nobody. Its time, the smallest over the ranks, is the collective's own
cost; the median over the calls is what the row reports. Message sizes follow the course's byte counters
(helpers/calc/comm.py): the whole tensor for all_reduce, reduce_scatter and broadcast, this rank's shard for
all_gather, the message for send_recv (every rank sends to the next and receives from the one before: both
directions at once) and for send (rank 0 to rank 1 only, one way, as a pipeline stage hands over its activations;
its cost is the receiver's, the others idle). With --gaps-ms, each size is timed again with every call after that
long without communication, as a step's collective follows its compute (notebook 11 prices each one at the pause it
followed); with --gap-max-bytes, only the sizes up to it, where a pause's fixed cost is not lost in the bytes'.
course/allreduce_bench.py (notebook 00) is the all-reduce alone, nccl-tests style.
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from helpers.rank.collective_ops import OPS, collective, tracing
from helpers.rank.devices import rank_device
from helpers.rank.metrics import Reporter
from helpers.rank.runtime import end_rank, launched_ranks, log0


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def timed(run, label: str, iters: int, device, idle: float = 0.0) -> list[float]:
    """``iters`` calls of ``run``, each between barriers (after ``idle`` seconds of sleep first) and inside a
    ``label`` span for the trace; this rank's seconds per call."""
    mine = []
    for _ in range(iters):
        if idle:
            time.sleep(idle)
        sync(device)
        with torch.profiler.record_function(label):
            t0 = time.perf_counter()
            run()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            mine.append(time.perf_counter() - t0)
    return mine


@record
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    parser.add_argument("--min-bytes", type=int, default=32 * 1024)
    parser.add_argument("--max-bytes", type=int, default=32 * 1024 ** 2)
    parser.add_argument("--factor", type=int, default=4, help="size multiplier between steps")
    parser.add_argument("--iters", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--gaps-ms", type=float, nargs="*", default=[],
                        help="after the calls back to back, time each size again with every call after this long "
                             "idle (ms; one pass per gap): a step's collective follows its compute, not another call")
    parser.add_argument("--gap-ops", nargs="+", choices=OPS, default=None,
                        help="the collectives timed after each gap (default: all of --ops)")
    parser.add_argument("--gap-iters", type=int, default=None, help="calls per gap (default: --iters)")
    parser.add_argument("--gap-max-bytes", type=int, default=None,
                        help="time the calls after each gap up to this size only (default: every size)")
    parser.add_argument("--trace", action="store_true",
                        help="time the calls inside torch.profiler, as the --profile-steps runs are, and write a "
                             "trace per rank to the run directory (each call a 'sweep <op> <bytes>' span)")
    args = parser.parse_args()
    if any(g <= 0 for g in args.gaps_ms):
        parser.error(f"--gaps-ms {args.gaps_ms}: each gap is a positive number of milliseconds")
    rank, local_rank, world = launched_ranks("torchrun --nproc-per-node 2 course/collective_sweep.py")
    if world < 2:
        raise SystemExit("a collective needs two ranks or more: torchrun --nproc-per-node 2 ...")
    device, backend = rank_device(local_rank)
    dist.init_process_group(backend)
    try:
        sizes, size = [], args.min_bytes
        while size <= args.max_bytes:
            sizes.append(size)
            size *= args.factor
        rep = Reporter(schema=None)
        if rank == 0:
            rep.total(len(sizes) * len(args.ops))
        log0(f"{world} ranks, backend {backend}, float32, {args.iters} timed calls after {args.warmup} warm-up\n"
             f"{'collective':<15} {'size (B)':>10} {'time (us)':>11}")
        row = 0
        with tracing(args.trace, rank, device):
            for op in args.ops:
                for size_bytes in sizes:
                    run = collective(op, size_bytes, rank, world, device)
                    for _ in range(args.warmup):
                        run()
                    mine = timed(run, f"sweep {op} {size_bytes}", args.iters, device)
                    gapped = op in (args.gap_ops or args.ops) and size_bytes <= (args.gap_max_bytes or size_bytes)
                    for gap in args.gaps_ms if gapped else []:  # each call after idling
                        timed(run, f"sweep {op} {size_bytes} gap {gap:g}", args.gap_iters or args.iters, device,
                              idle=gap / 1e3)
                    times = torch.tensor(mine, dtype=torch.float64, device=device)
                    every = [torch.empty_like(times) for _ in range(world)]
                    dist.all_gather(every, times)
                    per_call = list(zip(*(t.tolist() for t in every)))
                    # the last to arrive, per call; one way, the receiver (rank 1: the others take no part)
                    own = [call[1] for call in per_call] if op == "send" else [min(call) for call in per_call]
                    seconds = statistics.median(own)
                    row += 1
                    if rank == 0:
                        print(f"{op:<15} {size_bytes:>10} {seconds * 1e6:>11.1f}", flush=True)
                        rep.step(row, op=op, size_bytes=size_bytes, seconds=seconds, calls=own)
        if rank == 0:
            rep.result(world_size=world, backend=backend, ops=list(args.ops), sizes=sizes)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    end_rank(main())
