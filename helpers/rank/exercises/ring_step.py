"""Exercise task: the learner's one hop of ring attention, run inside a real ring and compared with one process.

    torchrun --nproc-per-node 3 helpers/rank/exercises/ring_step.py --answer answer.py

Every rank builds the same q, k, v (batch, heads, SEQ, head_dim) and keeps its positions of the sequence (zig-zag:
chunks r and 2W-1-r). The task runs the ring: the K/V block and its positions travel to the next rank by
``isend``/``irecv``, posted before the learner's ``ring_step(q, k, v, q_pos, k_pos, out, lse)`` merges the block that
has arrived into the running ``(out, lse)`` (0 and -inf before the first, this rank's own block). After W hops it
records ``out`` and ``lse`` beside causal attention of the whole sequence on one process, in float32 and float64 (their
gap is the rounding floor of the checker's tolerance), cut to this rank's positions, and what the learner's calls
sent (nothing: the ring is the task's). Then the same on one rank fewer with the contiguous layout (a new process
group without the last rank), where there are more than 2.
"""
import argparse
import math

import torch
import torch.distributed as dist

from helpers.rank.cp import layout_indices
from helpers.rank.exercises import load_answer, one_rank_fewer, run_task
from helpers.rank.exercises.traffic import DIST_NAMES, NOT_DATA, UNSEEN, Traffic
from helpers.rank.runtime import end_rank, launched_ranks

BATCH, HEADS, HEAD_DIM, CHUNK = 2, 2, 8, 3  # SEQ = 2 W CHUNK positions: every layout splits it


def inputs(seq: int, dtype):
    g = torch.Generator().manual_seed(seq)
    return [torch.randn(BATCH, HEADS, seq, HEAD_DIM, generator=g).to(dtype) for _ in range(3)]


def reference(q, k, v):
    """Causal softmax attention over the whole sequence, and each query's log-sum-exp of its scores."""
    s = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    n = q.size(-2)
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def main() -> int:
    rank, _, world = launched_ranks("torchrun --nproc-per-node 3 helpers/rank/exercises/ring_step.py --answer FILE")
    parser = argparse.ArgumentParser()
    parser.add_argument("--answer", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    ring_step = load_answer(args.answer, "ring_step")
    store = dist.distributed_c10d._get_default_store()

    def one_run(world: int, layout: str) -> dict:
        seq = 2 * world * CHUNK
        q, k, v = inputs(seq, torch.float32)
        mine = layout_indices(layout, seq, world, rank)
        q, kv = q[..., mine, :], [k[..., mine, :].contiguous(), v[..., mine, :].contiguous(), mine.clone()]
        out, lse = torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"))
        nxt, prv, calls, returned = (rank + 1) % world, (rank - 1) % world, [], None
        for hop in range(world):
            ops = []
            if hop + 1 < world:  # the next block in flight while this one is merged
                bufs = [torch.empty_like(t) for t in kv]
                ops = dist.batch_isend_irecv([dist.P2POp(dist.isend, t, nxt) for t in kv]
                                             + [dist.P2POp(dist.irecv, b, prv) for b in bufs])
            with Traffic() as traffic:
                returned = ring_step(q, kv[0], kv[1], mine, kv[2], out, lse)
            calls += [DIST_NAMES.get(op, op) for op, _n, _size in traffic.calls if op not in NOT_DATA]
            calls += [UNSEEN] * bool(traffic.unseen)
            if not (isinstance(returned, (tuple, list)) and len(returned) == 2
                    and all(isinstance(t, torch.Tensor) for t in returned)):
                for op in ops:
                    op.wait()
                return {"world_size": world, "layout": layout, "returned": type(returned).__name__}
            out, lse = returned
            for op in ops:
                op.wait()
            if ops:
                kv = bufs
        want = {name: reference(*inputs(seq, dtype)) for name, dtype in (("fp32", torch.float32),
                                                                       ("fp64", torch.float64))}
        fields = {"world_size": world, "layout": layout, "positions": mine.tolist(),
                  "learner_calls": sorted(set(calls)),
                  "shapes_ok": tuple(out.shape) == tuple(q.shape) and tuple(lse.shape) == tuple(q.shape[:-1])}
        if fields["shapes_ok"]:
            fields["answer"] = {"out": out.detach().flatten().tolist(), "lse": lse.detach().flatten().tolist()}
            for name, (o, l) in want.items():
                fields[name] = {"out": o[..., mine, :].flatten().tolist(), "lse": l[..., mine].flatten().tolist()}
        return fields

    def task():
        runs = [one_run(world, "zigzag")]
        if world > 2 and one_rank_fewer(rank, world, store):  # a merge that only works for one ring length fails
            runs.append(one_run(world - 1, "contiguous"))
        return {"world_size": world, "runs": runs}

    run_task(rank, task)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    end_rank(main())
