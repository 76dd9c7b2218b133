"""How much DeepSpeed's JIT-built ops cost a learner's first run, measured side by side (a benchmark: it prints).

Cold: a fresh, empty TORCH_EXTENSIONS_DIR, so DeepSpeed must compile its CPU communication op (and, with
--fused-adam, FusedAdam) during the launch. Warm: the cache `make setup` filled. Same 2-rank, 5-step stage-0 run.

    .venv/bin/python benchmarks/bench_ds_first_launch.py [--fused-adam]
"""
import argparse
import os
import tempfile

from helpers.calc import dsconfig
from helpers.rank.deepspeed_facts import build_config
from helpers import launch


def one_run(extensions_dir: str | None, torch_adam: bool) -> float:
    env = {"TORCH_EXTENSIONS_DIR": extensions_dir} if extensions_dir else {}
    config = build_config(stage=0, micro_batch=16, world_size=2, torch_adam=torch_adam)
    run = launch.deepspeed("course/ds_cifar10.py", nproc=2, config=config, env=env, show="none", timeout=900,
                           name="bench_ds_first_launch",
                           args=["--dataset", "synthetic", "--train-size", 320, "--test-size", 64, "--steps", 5])
    return run.duration_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fused-adam", action="store_true", help="use DeepSpeed's FusedAdam (another JIT build)")
    args = parser.parse_args()
    torch_adam = not args.fused_adam
    warm_dir = os.environ.get("TORCH_EXTENSIONS_DIR")  # None: the default cache that make setup filled
    one_run(warm_dir, torch_adam)  # make sure the warm cache really is warm
    with tempfile.TemporaryDirectory() as cold_dir:
        cold = one_run(cold_dir, torch_adam)
    warm = one_run(warm_dir, torch_adam)
    print(f"first launch, {'FusedAdam' if args.fused_adam else 'torch Adam'}: cold (empty extension cache) "
          f"{cold:.1f} s | warm (prebuilt by make setup) {warm:.1f} s | cold/warm {cold / warm:.1f}x")


if __name__ == "__main__":
    main()
