"""DDP on this machine, measured side by side in one run (a benchmark, not a test: it prints ratios).

1. Scaling: course/ddp_cifar10.py with 2 ranks x 1 thread vs 1 rank x 2 threads, same data, same global batch.
   On a 2-core CPU both use the same two cores, so the honest target is "DDP costs little", not a speedup:
   samples/s ratio (2 ranks / 1 rank) >= 0.9.
2. Metrics overhead: the time helpers.rank.metrics.Reporter.step adds to one training step of SimpleCNN, in percent.
   Target < 2 %.

    .venv/bin/python benchmarks/bench_ddp.py [--repeats 3] [--train-size 4000]
"""
import argparse
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F

from helpers import launch
from helpers.rank.metrics import Reporter
from helpers.rank.models import SimpleCNN


def scaling(repeats: int, train_size: int) -> None:
    rates = {1: [], 2: []}
    global_batch = 64
    for i in range(repeats):  # interleaved, so drifting machine load hits both sides alike
        for nproc in (1, 2):
            run = launch.torchrun("course/ddp_cifar10.py", nproc=nproc, show="none", timeout=600, name="bench_ddp",
                                  args=["--epochs", "1", "--train-size", str(train_size), "--test-size", "500",
                                        "--dataset", "synthetic", "--batch-size", str(global_batch // nproc)])
            rates[nproc].append(run.result["samples_per_s"])
            print(f"  repeat {i}: {nproc} rank(s) x {launch.cpu_count() // nproc} thread(s): "
                  f"{run.result['samples_per_s']:.0f} samples/s, peak RSS/rank {run.result['peak_rss_mib']:.0f} MiB",
                  flush=True)
    one, two = statistics.median(rates[1]), statistics.median(rates[2])
    ratio = two / one
    print(f"scaling: median samples/s  1 rank {one:.0f} | 2 ranks {two:.0f} | ratio {ratio:.3f} "
          f"(target >= 0.9: {'PASS' if ratio >= 0.9 else 'FAIL'})")


def reporter_overhead(steps: int = 200) -> None:
    torch.manual_seed(0)
    model = SimpleCNN()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))

    def step():
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    for _ in range(10):
        step()
    with tempfile.TemporaryDirectory() as tmp:
        rep = Reporter(run_dir=tmp, rank=0)
        plain, reported = [], []
        for i in range(steps):  # alternate plain and reported steps
            t0 = time.perf_counter()
            step()
            plain.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            loss = step()
            rep.step(i, loss=loss.item(), samples=32)
            reported.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for i in range(steps):
            rep.step(i, loss=1.0, samples=32)
        write_s = (time.perf_counter() - t0) / steps
        rep.close()
    step_s = statistics.median(plain)
    pct = 100 * write_s / step_s
    print(f"metrics: median step {step_s * 1e3:.2f} ms, Reporter.step {write_s * 1e6:.1f} us -> {pct:.3f} % of a step "
          f"(median step with reporting {statistics.median(reported) * 1e3:.2f} ms) "
          f"(target < 2 %: {'PASS' if pct < 2 else 'FAIL'})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--train-size", type=int, default=4000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    reporter_overhead()
    scaling(args.repeats, args.train_size)


if __name__ == "__main__":
    main()
