"""One rank of a real model's layout, simulated in one process: nothing allocated, nothing sent.

Run it from any directory, in a terminal (after `pip install -e .`, which `make setup` does); no torchrun:

    python course/gpt_at_scale.py --model llama3-8b --world 64 --tp 8           # FSDP2 over 8, TP + SP over 8
    python course/gpt_at_scale.py --model gpt3-175b --world 1024 --tp 8 --pp 16 --stage 1
    python course/gpt_at_scale.py --model deepseek-v3 --world 2048 --tp 1 --pp 16 --ep 64 --stage 1
    python course/gpt_at_scale.py --model llama3-405b --seq-len 131072 --world 16384 --tp 8 --pp 16 --cp 16

The process joins a fake process group of --world ranks as rank 0 (torch.testing._internal.distributed.fake_pg:
every collective returns at once and moves nothing). The course GPT (helpers.rank.gpt) is built at a published
model's shape (helpers.calc.scale.MODELS) on the meta device, where init_device_mesh, parallelize_module and
fully_shard build what rank 0 of the real job would hold (inside FakeTensorMode the mesh's rank numbers would be
faked), then materialised under FakeTensorMode: every tensor has its shape, dtype and size, none has storage. One
training step of one micro-batch on the layers of stage --stage of --pp: TP + SP over --tp (course/gpt_tp.py's plan),
FSDP2 over the data-parallel ranks (fp32 shards, bf16 compute), AdamW; a mixture of experts' routed experts spread
over --ep of the data-parallel ranks (helpers.rank.at_scale.BalancedMoE); with --cp, each sequence split over the CP
ranks (zig-zag) and attention run as chapter 12's ring (helpers.rank.cp), FSDP2 over dp x cp. FSDPMemTracker
(torch.distributed._tools) splits the rank's memory into sharded parameters, gradients, optimizer state, activations
and FSDP's buffers, and the highest total of forward and backward (read before AdamW's step: under the fake group the
tracker counts its states at their unsharded size while it steps, which a real rank never allocates). The script
prints them and the bytes the all-to-alls and the ring send beside the course's formulas (helpers.calc.scale.expected),
or JSON with --json; several --stage and --checkpoint values run in turn in this one process.

The fake group and FakeTensorMode are private APIs (torch.testing._internal, torch._subclasses): tests/test_at_scale.py
pins them.
"""
import argparse
import json

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from helpers.calc import scale, stages
from helpers.rank import cp
from helpers.rank.at_scale import build
from helpers.rank.moe import STATS
from helpers.rank.runtime import end_rank

KINDS = {"params": _FSDPRefType.SHARDED_PARAM, "grads": _FSDPRefType.SHARDED_GRAD, "optimizer": _FSDPRefType.OPT,
         "activations": _FSDPRefType.ACT, "all-gather buffers": _FSDPRefType.ALL_GATHER,
         "reduce-scatter buffers": _FSDPRefType.REDUCE_SCATTER, "unsharded params": _FSDPRefType.UNSHARDED_PARAM,
         "temporaries": _FSDPRefType.TEMP}
STATES = ("params", "grads", "optimizer")  # read after the step; the rest at the step's peak


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(scale.MODELS), default="llama3-8b")
    p.add_argument("--world", type=int, default=64, help="ranks in the job (GPUs)")
    p.add_argument("--tp", type=int, default=8, help="tensor-parallel degree (with sequence parallelism above 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages")
    p.add_argument("--stage", type=int, nargs="+", default=[0], help="the stage(s) whose rank 0 is simulated")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks, taken from dp (a MoE model)")
    p.add_argument("--cp", type=int, default=1, help="context-parallel ranks: ring attention, zig-zag (a dense model)")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    p.add_argument("--checkpoint", choices=("none", "full"), nargs="+", default=["none"],
                   help="full: recompute each block in backward (only its input is kept); several: each in turn")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the model's)")
    p.add_argument("--json", action="store_true", help="print a JSON object a run instead of the table")
    return p.parse_args(argv)


def runs(args) -> list[argparse.Namespace]:
    """One run per stage and recomputation asked for (every one in this process: torch is imported once), each
    refused before any is built if it cannot be."""
    todo = [argparse.Namespace(**{**vars(args), "stage": s, "checkpoint": c}) for s in args.stage
            for c in args.checkpoint]
    for run in todo:
        problem = scale.layout_problem(_shape(run), run.world, run.tp, run.pp, run.stage, run.ep, run.cp)
        if problem:
            raise SystemExit(problem)
    return todo


def _shape(args) -> dict:
    return dict(scale.MODELS[args.model], **({"seq_len": args.seq_len} if args.seq_len else {}))


def simulate(args) -> dict:
    """One run of :func:`runs`: its measured and formula bytes."""
    shape = _shape(args)
    dp = args.world // (args.tp * args.pp * args.cp)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world)
    try:
        mesh = init_device_mesh("cpu", (args.pp, dp // args.ep, args.ep, args.cp, args.tp),
                                mesh_dim_names=("pp", "edp", "ep", "cp", "tp"))
        meshes = {name: mesh[name] for name in ("edp", "ep", "cp", "tp")}
        meshes["dp"] = mesh["edp", "ep", "cp"]._flatten("dp")  # the dense weights' FSDP group (torchtitan's way)
        layers = stages.rank_layers(shape, args.pp, args.stage)
        # on the meta device: the mesh's rank numbers stay real tensors
        model = build(shape, layers, args.stage == 0, args.stage == args.pp - 1, meshes, args.ep, args.checkpoint)
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")  # fake tensors: a size, no storage
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            b, s = args.micro_batch, shape["seq_len"] // args.cp  # this rank's positions of each sequence
            if args.stage == 0:
                x = torch.randint(0, shape["vocab"], (b, s))
            else:  # the previous stage's output, this rank's s / tp positions under SP
                x = torch.randn(b, s // args.tp, shape["d_model"], dtype=torch.bfloat16, requires_grad=True)
            STATS.reset()  # the MoE layers count the bytes their all-to-alls send, the ring its own
            cp.STATS.reset()
            tracker = FSDPMemTracker(model, optimizer)
            tracker.track_inputs((x,))
            with tracker:
                out = logits = model(x)
                if args.stage == args.pp - 1:  # the loss in fp32, the logits held: the course GPT returns both
                    y = torch.randint(0, shape["vocab"], (b, s))
                    out = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
                after_forward = tracker.get_tracker_snapshot("current")
                out.backward(torch.ones_like(out))
                peak = tracker.get_tracker_snapshot("peak")  # of forward and backward (see the docstring)
                optimizer.step()
                after_step = tracker.get_tracker_snapshot("current")  # what stays: the model states
    finally:
        dist.destroy_process_group()
    measured = {k: _bytes(after_step if k in STATES else peak, kind) for k, kind in KINDS.items()}
    # what the micro-batch holds until its backward: what autograd saved, its output, and its input (the token ids,
    # or the activations the previous stage sent), which the tracker files apart as inputs
    measured["activations after forward"] = sum(_bytes(after_forward, k) for k in (_FSDPRefType.ACT, _FSDPRefType.INP))
    measured["peak"] = sum(per["Total"] for per in peak.values())  # every kind at the step's highest moment
    measured["all-to-all bytes sent"] = sum(v for d in STATS.sent_bytes.values() for v in d.values())
    measured["ring bytes sent"] = sum(phase["sent_bytes"] for phase in cp.STATS.counts.values())
    lay = dict(world=args.world, tp=args.tp, pp=args.pp, stage=args.stage, micro_batch=args.micro_batch, ep=args.ep,
               checkpoint=args.checkpoint, cp=args.cp)
    return dict(model=args.model, shape=shape, dp=dp, **lay, measured=measured, formula=scale.expected(shape, **lay))


def _bytes(snapshot: dict, kind) -> int:
    """One kind's bytes in a tracker snapshot ({device: {kind: bytes}}), summed over the devices."""
    return sum(per.get(kind, 0) for per in snapshot.values())


def main(argv=None) -> int:
    for args in runs(parse_args(argv)):
        result = simulate(args)
        if args.json:
            print(json.dumps(result))
        else:
            show(args, result)
    return 0


def show(args, result: dict) -> None:
    f, m = result["formula"], result["measured"]
    print(f"{args.model} on {args.world} ranks: dp {result['dp']} (ep {args.ep}) x cp {args.cp} x tp {args.tp} x pp "
          f"{args.pp}, stage {args.stage} ({f['blocks']} blocks), micro-batch {args.micro_batch} x "
          f"{result['shape']['seq_len']} tokens, checkpoint {args.checkpoint}")
    sent = [k for k, degree in (("all-to-all bytes sent", args.ep), ("ring bytes sent", args.cp)) if degree > 1]
    for key, formula in [*zip(STATES, STATES), ("activations after forward", "activations"), *zip(sent, sent)]:
        print(f"  {key:28s} {m[key] / 2**30:9.3f} GiB   formula {f[formula] / 2**30:9.3f} GiB")
    for key in ("all-gather buffers", "reduce-scatter buffers", "unsharded params", "temporaries"):
        print(f"  {key:28s} {m[key] / 2**30:9.3f} GiB   (at the peak)")
    print(f"  {'peak, everything':28s} {m['peak'] / 2**30:9.3f} GiB")


if __name__ == "__main__":
    end_rank(main())
