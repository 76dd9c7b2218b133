"""Fixture for the deepspeed launcher smoke test: a tiny model, two DeepSpeed steps on CPU ranks.

Launched by ``helpers.launch.deepspeed(..., config={...})``, which passes ``--deepspeed_config <file>``.
"""
import argparse
import os

import deepspeed
import torch
import torch.distributed as dist

from helpers.rank.metrics import Reporter
from helpers.rank.runtime import end_rank


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    print(f"pid={os.getpid()} rank={rank} start", flush=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    rep = Reporter(schema=None)
    rep.total(2)
    micro = engine.train_micro_batch_size_per_gpu()
    for step in range(2):
        x = torch.randn(micro, 8)
        y = torch.randint(0, 2, (micro,))
        loss = torch.nn.functional.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        rep.step(step + 1, loss=loss.item())  # steps are numbered from 1, as in every course script
        print(f"rank {rank} step {step} loss={loss.item():.4f}", flush=True)
    rep.result(steps_done=2, world_size=dist.get_world_size(), ds_world_size=engine.world_size)
    dist.destroy_process_group()


if __name__ == "__main__":
    end_rank(main())
