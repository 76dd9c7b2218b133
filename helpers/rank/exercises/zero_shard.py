"""Exercise task: ZeRO-1 by hand. The learner's optimizer keeps state for this rank's 1/N of the weights only.

    torchrun --nproc-per-node 3 helpers/rank/exercises/zero_shard.py --answer answer.py

The learner's ``zero1_train(model, batches)`` trains ``model`` (the same on every rank) on this rank's batches, one
AdamW step per batch: all-reduce the gradients and average them, step its shard of the flattened parameters, gather
every rank's updated shard back into the model. It runs twice, in float32 and in float64 (the default dtype set to
match, so the learner's own tensors follow). The rank records its final weights from both runs, the optimizers that
stepped (the elements they hold, the bytes of their state), the bytes it sent per step under the ring model
(:func:`helpers.calc.comm.bytes_sent_per_rank`), and one process's weights after the same steps on every rank's
samples at once: DDP's result, in float32 and float64 (their gap is the rounding floor), and two classic mistakes in
float64 for the checker to recognise, "summed" (gradients summed over ranks, not averaged) and "gather_first" (the
shards gathered into the model before the step, so the model is always one step behind). The bytes are counted at
the process group (:class:`helpers.rank.exercises.traffic.Traffic`: any name of a collective). Then all of it again
on one rank fewer (a new process group without the last rank), where there are more than 2.
"""
import argparse
import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from helpers.calc.comm import bytes_sent_per_rank
from helpers.rank.exercises import load_answer, one_rank_fewer, run_task
from helpers.rank.exercises.traffic import DIST_NAMES, Traffic
from helpers.rank.runtime import end_rank, launched_ranks

FEATURES, HIDDEN, CLASSES = 7, 16, 3  # 179 parameters: not a multiple of 2, 3 or 4 ranks, so one shard is short
BATCH, STEPS, LR = 8, 3, 0.01


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, CLASSES))


def samples(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(BATCH, FEATURES, generator=g)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()


def flat(model) -> list[float]:
    return parameters_to_vector(model.parameters()).detach().double().tolist()


def one_process(model, world: int, dtype, variant: str = "right") -> list[float]:
    """One process, every rank's samples in each step's batch: the mean gradient, one AdamW over the whole model."""
    model = copy.deepcopy(model).to(dtype)
    params = list(model.parameters())
    master = parameters_to_vector(params).detach().clone().requires_grad_()
    optimizer = torch.optim.AdamW([master], lr=LR)
    for step in range(STEPS):
        pieces = [samples(step, r) for r in range(world)]
        x, y = torch.cat([p[0] for p in pieces]).to(dtype), torch.cat([p[1] for p in pieces])
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        master.grad = parameters_to_vector([p.grad for p in params]) * (world if variant == "summed" else 1)
        if variant == "gather_first":  # the model gets the weights from before this step
            vector_to_parameters(master.detach().clone(), params)
        optimizer.step()
        if variant != "gather_first":
            vector_to_parameters(master.detach().clone(), params)
    return flat(model)


def state_bytes(optimizer) -> int:
    return sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
               if isinstance(t, torch.Tensor))


def sent_bytes(traffic: Traffic, world: int) -> float:
    """What this rank sent in the calls ``traffic`` counted (at the process group, whatever name the learner used),
    each call's message converted to what one rank sends under the usual ring algorithms."""
    return sum(bytes_sent_per_rank(DIST_NAMES.get(op, op), size, world) for op, _n, size in traffic.calls
               if op not in ("recv", "recv_anysource", "barrier", "monitored_barrier"))


def main() -> int:
    rank, _, world = launched_ranks("torchrun --nproc-per-node 3 helpers/rank/exercises/zero_shard.py --answer FILE")
    parser = argparse.ArgumentParser()
    parser.add_argument("--answer", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    zero1_train = load_answer(args.answer, "zero1_train")
    stepped = []  # every optimizer that steps, in order (a global hook: the learner builds their own)
    register_optimizer_step_pre_hook(lambda opt, a, k: stepped.append(opt))

    store = dist.distributed_c10d._get_default_store()

    def one_run(world: int) -> dict:
        model = make_model()
        numel = sum(p.numel() for p in model.parameters())
        whole = copy.deepcopy(model)
        whole_optimizer = torch.optim.AdamW(whole.parameters(), lr=LR)
        nn.functional.cross_entropy(whole(samples(0, 0)[0]), samples(0, 0)[1]).backward()
        whole_optimizer.step()  # a whole-model AdamW's state, in bytes: what DDP keeps on every rank
        reference = {"fp32": one_process(model, world, torch.float32),
                     "fp64": one_process(model, world, torch.float64),
                     "summed": one_process(model, world, torch.float64, "summed"),
                     "gather_first": one_process(model, world, torch.float64, "gather_first")}
        runs = {}
        for name, dtype in (("fp32", torch.float32), ("fp64", torch.float64)):
            stepped.clear()
            trained = copy.deepcopy(model).to(dtype)
            batches = [tuple(t.to(dtype) if t.is_floating_point() else t for t in samples(s, rank))
                       for s in range(STEPS)]  # drawn in float32, as the reference's: randn draws per dtype
            torch.set_default_dtype(dtype)
            try:
                with Traffic() as traffic:
                    zero1_train(trained, batches)
            finally:
                torch.set_default_dtype(torch.float32)
            optimizers = list({id(o): o for o in stepped}.values())
            runs[name] = {"weights": flat(trained), "steps": len(stepped), "optimizers": len(optimizers),
                          "held": max((sum(p.numel() for g in o.param_groups for p in g["params"])
                                       for o in optimizers), default=0),
                          "state_bytes": max((state_bytes(o) for o in optimizers), default=0),
                          "sent_per_step": sent_bytes(traffic, world) / STEPS}
        return {"world_size": world, "numel": numel, "steps": STEPS, "start": flat(model),
                "whole_state_bytes": state_bytes(whole_optimizer),
                "ddp_sent_per_step": bytes_sent_per_rank("all_reduce", 4 * numel, world),
                "runs": runs, "reference": reference}

    def task():
        runs = [one_run(world)]
        if world > 2 and one_rank_fewer(rank, world, store):  # a hard-coded rank count is right at most once
            runs.append(one_run(world - 1))
        return {"world_size": world, "runs": runs}

    run_task(rank, task)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    end_rank(main())
