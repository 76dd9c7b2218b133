"""Context parallelism inside a rank: every sequence split along its positions over the CP ranks, and the two ways
attention still sees the whole sequence (notebook 12, course/gpt_cp.py).

* **Ring attention** (Liu et al. 2023; ring-flash-attention's shape): each rank keeps its queries; the K/V blocks
  travel round the ring, ``W - 1`` hops, the next block's exchange posted before this block's compute so the two
  overlap. Each block's partial softmax is merged into the running one with the log-sum-exp update (a running max:
  no exp overflows), so the result is exact. Under the causal mask a block whose keys all lie in the future of every
  query is skipped. Backward runs the ring again: K/V travel as in forward, and each block's dK/dV accumulator
  travels with them, ``W - 1`` hops, arriving home with every rank's contribution (:class:`_RingAttention`).
* **Ulysses** (DeepSpeed-Ulysses, Jacobs et al. 2023): an all-to-all turns "my positions, every head" into "every
  position, my heads" (``H / W`` of them), attention runs locally over the whole sequence, a second all-to-all turns
  it back. Needs ``heads % W == 0``.

Layouts: "contiguous" gives rank ``r`` positions ``[r s/W, (r+1) s/W)``: under the causal mask the last rank attends to
everything and the first to one block (work ``1 : 2 : ... : W``). "zigzag" cuts the sequence into ``2W`` chunks and
gives rank ``r`` chunks ``r`` and ``2W-1-r``: every rank the same work (:func:`zigzag_positions`).

Every call counts what this rank did in :data:`STATS` (bytes sent/received, blocks computed/skipped, query-key
pairs computed, seconds computing), per phase, read by the script and compared with :mod:`helpers.calc.cp`.

Example (inside a rank; q, k, v: (batch, heads, s / W, head_dim), this rank's positions)::

    idx = layout_indices("zigzag", seq_len, world, rank)        # which positions this rank holds
    y = ring_attention(q, k, v, group, causal=True, layout="zigzag")
"""
from __future__ import annotations

import bisect
import copy
import gc
import math
import re
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..calc import parity
from .gpt import attention_core

LAYOUTS = ("zigzag", "contiguous")
PHASES = ("forward", "backward")
SETTLE_READS = 10  # forward_activation_bytes: reads 10 ms apart, the lowest kept (gloo frees a call's buffers late)
_KV_TAG, _DKV_TAG = 12, 13  # the ring's two kinds of message between the same pair of ranks never mix


# ---------------------------------------------------------------------------------------------- layouts


def zigzag_positions(seq_len: int, world: int, rank: int) -> list[int]:
    """The positions rank ``rank`` of ``world`` holds under the zig-zag layout: chunks ``rank`` and
    ``2 world - 1 - rank`` of ``2 world`` equal chunks, in order.

        >>> zigzag_positions(8, 2, 0)
        [0, 1, 6, 7]
    """
    if seq_len % (2 * world):
        raise ValueError(f"zig-zag needs seq_len divisible by 2 x CP = {2 * world}, got {seq_len}")
    c = seq_len // (2 * world)
    return [*range(rank * c, (rank + 1) * c), *range((2 * world - 1 - rank) * c, (2 * world - rank) * c)]


def contiguous_positions(seq_len: int, world: int, rank: int) -> list[int]:
    """Positions ``[rank s/W, (rank+1) s/W)``."""
    if seq_len % world:
        raise ValueError(f"the contiguous layout needs seq_len divisible by CP = {world}, got {seq_len}")
    return list(range(rank * seq_len // world, (rank + 1) * seq_len // world))


def layout_positions(layout: str, seq_len: int, world: int, rank: int) -> list[int]:
    """The positions (ascending, Python ints) rank ``rank`` holds under ``layout`` (:data:`LAYOUTS`). The ring decides
    which blocks to compute from these values, which a fake tensor does not hold (notebook 14 runs the ring under
    FakeTensorMode): so they are plain numbers, and :func:`layout_indices` the tensor made of them."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return (zigzag_positions if layout == "zigzag" else contiguous_positions)(seq_len, world, rank)


def layout_indices(layout: str, seq_len: int, world: int, rank: int) -> torch.Tensor:
    """:func:`layout_positions` as an int64 tensor.

        >>> layout_indices("zigzag", 8, 2, 1).tolist()
        [2, 3, 4, 5]
    """
    return torch.tensor(layout_positions(layout, seq_len, world, rank), dtype=torch.int64)


def shard_sequence(t: torch.Tensor, layout: str, world: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's positions of ``t`` along ``dim`` (tokens: (batch, seq) -> (batch, seq / W))."""
    return t.index_select(dim, layout_indices(layout, t.size(dim), world, rank).to(t.device))


def unshard_sequence(parts: list[torch.Tensor], layout: str, dim: int = 1) -> torch.Tensor:
    """The inverse of :func:`shard_sequence`: every rank's part (in rank order) back into position order.

        >>> x = torch.arange(8)[None]; unshard_sequence([shard_sequence(x, "zigzag", 2, r) for r in (0, 1)], "zigzag")
        tensor([[0, 1, 2, 3, 4, 5, 6, 7]])
    """
    world, whole = len(parts), torch.cat(parts, dim)
    where = torch.cat([layout_indices(layout, whole.size(dim), world, r) for r in range(world)])
    return whole.index_select(dim, torch.argsort(where).to(whole.device))


# ---------------------------------------------------------------------------------------------- counters


class CPStats:
    """What this rank's context-parallel attention did, per phase: ``sent_bytes``, ``recv_bytes``, ``blocks_computed``,
    ``blocks_skipped`` (ring only), ``work_pairs`` (query-key pairs computed, summed over batch and heads: the
    FLOP-equivalent unit, 4 x head_dim flops each in forward), ``compute_s`` (seconds in attention arithmetic)."""

    FIELDS = ("sent_bytes", "recv_bytes", "blocks_computed", "blocks_skipped", "work_pairs", "compute_s")

    def __init__(self):
        self.reset()

    def reset(self) -> None:  # the script resets after its parity probe: the training steps only
        self.counts = {phase: dict.fromkeys(self.FIELDS, 0) for phase in PHASES}

    def add(self, phase: str, **amounts) -> None:
        for name, amount in amounts.items():
            self.counts[phase][name] += amount

    def per_step(self, steps: int) -> dict:
        """The counts divided by ``steps`` (what one training step did)."""
        return {phase: {k: v / steps for k, v in c.items()} for phase, c in self.counts.items()}


STATS = CPStats()


# ---------------------------------------------------------------------------------------------- blocks


def visible_block(q_pos, k_pos, causal: bool):
    """(rows, cols, masked) of the query rows and key columns in which the causal mask leaves any pair (slices: both
    position lists ascend, so the rows are a suffix and the columns a prefix), ``masked``: some pair in that rectangle
    is in the future; None when every pair is (the block is skipped). Positions: Python ints or real tensors."""
    q_pos, k_pos = _ints(q_pos), _ints(k_pos)
    n, m = len(q_pos), len(k_pos)
    if not causal:
        return slice(0, n), slice(0, m), False
    r0 = bisect.bisect_left(q_pos, k_pos[0])  # first query that sees the first key
    c1 = bisect.bisect_right(k_pos, q_pos[-1])  # keys up to the last query's position
    if r0 == n or c1 == 0:
        return None
    return slice(r0, n), slice(0, c1), k_pos[c1 - 1] > q_pos[r0]


def _ints(pos) -> list[int]:
    return pos.tolist() if isinstance(pos, torch.Tensor) else pos


def _scores(q, k, q_pos, k_pos, masked: bool, scale: float):
    s = (q @ k.transpose(-2, -1)) * scale
    return s.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf")) if masked else s


def block_attention(q, k, v, q_pos, k_pos, causal: bool = True, seen=...):
    """Attention of queries ``q`` over ONE block of keys/values: ``(rows, out, lse, pairs)`` for the visible rows (out:
    the softmax over this block only, lse: log-sum-exp of its scores, pairs: query-key pairs computed per batch x
    head), or None when the mask hides the whole block. ``seen``: :func:`visible_block`'s answer for these positions,
    where the caller has it (the ring: from Python ints, as fake position tensors cannot give it)."""
    seen = visible_block(q_pos, k_pos, causal) if seen is ... else seen
    if seen is None:
        return None
    rows, cols, masked = seen
    s = _scores(q[..., rows, :], k[..., cols, :], q_pos[rows], k_pos[cols], masked, 1.0 / math.sqrt(q.size(-1)))
    lse = torch.logsumexp(s, dim=-1)
    return rows, torch.exp(s - lse.unsqueeze(-1)) @ v[..., cols, :], lse, s.size(-2) * s.size(-1)


def block_softmax(q, k, v, q_pos, k_pos):
    """Causal attention of the queries ``q`` (at positions ``q_pos``) over ONE block of keys and values alone (at
    ``k_pos``): ``(block_out, block_lse)`` for every query row, the softmax over this block's visible keys and the
    log-sum-exp of their scores. A row that sees no key of the block gets ``block_out`` 0 and ``block_lse`` -inf,
    which a log-sum-exp merge weighs by e^-inf = 0. What notebook 12's exercise gives the learner to merge."""
    s = _scores(q, k, q_pos, k_pos, True, 1.0 / math.sqrt(q.size(-1)))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)  # a row of -inf only: e^(-inf + inf) is nan, there 0
    return p @ v, lse


def merge_blocks(out, lse, block_out, block_lse):
    """The log-sum-exp update: two softmax-normalised partial results over disjoint keys -> the one over both. The
    running max ``m`` keeps every exponent <= 0; ``lse = -inf`` (no keys yet) takes the block as it is.

        out = out e^(lse - new) + block_out e^(block_lse - new),   new = m + log(e^(lse - m) + e^(block_lse - m))
    """
    m = torch.maximum(lse, block_lse)
    a, b = torch.exp(lse - m), torch.exp(block_lse - m)
    new = m + torch.log(a + b)
    return out * torch.exp(lse - new).unsqueeze(-1) + block_out * torch.exp(block_lse - new).unsqueeze(-1), new


def ring_order(world: int, rank: int) -> list[int]:
    """Whose K/V block rank ``rank`` holds at each step of the ring (its own first, then its predecessors')."""
    return [(rank - step) % world for step in range(world)]


def simulate_ring(q, k, v, world: int, layout: str = "zigzag", causal: bool = True):
    """Ring attention on ONE process: the full q, k, v (batch, heads, seq, head_dim) split as ``world`` ranks would hold
    them, each "rank" merging the blocks in its ring order. Returns (output in position order, work_pairs per rank per
    (batch x head)). The reference the distributed version and the notebook's exercise are held to."""
    s, out_parts, work = q.size(-2), [], []
    pos = [layout_indices(layout, s, world, r).to(q.device) for r in range(world)]
    for r in range(world):
        qr = q.index_select(-2, pos[r])
        out, lse, pairs = torch.zeros_like(qr), torch.full(qr.shape[:-1], float("-inf"), dtype=q.dtype), 0
        for src in ring_order(world, r):
            block = block_attention(qr, k.index_select(-2, pos[src]), v.index_select(-2, pos[src]), pos[r], pos[src],
                                    causal)
            if block is not None:
                rows, bo, bl, n = block
                out[..., rows, :], lse[..., rows] = merge_blocks(out[..., rows, :], lse[..., rows], bo, bl)
                pairs += n
        out_parts.append(out)
        work.append(pairs)
    return unshard_sequence(out_parts, layout, dim=-2), work


# ---------------------------------------------------------------------------------------------- the ring


def _ring_peers(group):
    me, w = dist.get_rank(group), dist.get_world_size(group)
    return me, w, (me + 1) % w, (me - 1) % w


def _exchange(tensors, group, tag: int, phase: str):
    """Post: send ``tensors`` to the next rank of the ring, receive as many from the previous one. Returns (buffers,
    works); wait on the works before reading the buffers. Nothing waits here: the caller computes meanwhile."""
    _, _, nxt, prv = _ring_peers(group)
    bufs = [torch.empty_like(t) for t in tensors]
    ops = ([dist.P2POp(dist.isend, t, group=group, tag=tag, group_peer=nxt) for t in tensors]
           + [dist.P2POp(dist.irecv, b, group=group, tag=tag, group_peer=prv) for b in bufs])
    n = sum(t.numel() * t.element_size() for t in tensors)
    STATS.add(phase, sent_bytes=n, recv_bytes=n)
    return bufs, dist.batch_isend_irecv(ops)


def _wait(works) -> None:
    for w in works:
        w.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, layout):
        me, w, _, _ = _ring_peers(group)
        ids = [layout_positions(layout, q.size(-2) * w, w, r) for r in range(w)]  # numbers: which blocks to compute
        pos = [torch.tensor(p, device=q.device) for p in ids]  # tensors: the mask inside a block
        wide = torch.promote_types(q.dtype, torch.float32)  # the log-sum-exp in fp32 at least, as flash keeps it
        out, lse = torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"), dtype=wide, device=q.device)
        kv = [k.contiguous(), v.contiguous()]
        for step, src in enumerate(ring_order(w, me)):
            pending = _exchange(kv, group, _KV_TAG, "forward") if step + 1 < w else None  # next block in flight
            t0 = time.perf_counter()
            block = block_attention(q, kv[0], kv[1], pos[me], pos[src], seen=visible_block(ids[me], ids[src], causal))
            if block is None:
                STATS.add("forward", blocks_skipped=1)
            else:
                rows, bo, bl, n = block
                out[..., rows, :], lse[..., rows] = merge_blocks(out[..., rows, :], lse[..., rows], bo, bl)
                STATS.add("forward", blocks_computed=1, work_pairs=n * bo.shape[:-2].numel())
            STATS.add("forward", compute_s=time.perf_counter() - t0)
            if pending:
                kv, works = pending
                _wait(works)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.ids = group, causal, ids  # numbers, not tensors: nothing more kept per rank
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, ids = ctx.group, ctx.causal, ctx.ids
        pos = [torch.tensor(p, device=q.device) for p in ids]
        me, w, _, _ = _ring_peers(group)
        scale = 1.0 / math.sqrt(q.size(-1))
        delta = (dout * out).sum(-1)  # rowsum(dO * O): softmax's backward term, once for all blocks
        kv, travelling = [k.contiguous(), v.contiguous()], None
        dq, dk_own, dv_own = torch.zeros_like(q), torch.zeros_like(kv[0]), torch.zeros_like(kv[1])  # contiguous: sent
        for step, src in enumerate(ring_order(w, me)):
            pending = _exchange(kv, group, _KV_TAG, "backward") if step + 1 < w else None
            if step >= 2:  # the dK/dV of block `src` so far, from the ranks it has already visited
                acc, works = travelling
                _wait(works)
            else:
                acc = [torch.zeros_like(kv[0]), torch.zeros_like(kv[1])]
            t0 = time.perf_counter()
            seen = visible_block(ids[me], ids[src], causal)
            if seen is None:
                STATS.add("backward", blocks_skipped=1)
            else:
                rows, cols, masked = seen
                qr, kc, vc, do = q[..., rows, :], kv[0][..., cols, :], kv[1][..., cols, :], dout[..., rows, :]
                p = torch.exp(_scores(qr, kc, pos[me][rows], pos[src][cols], masked, scale)
                              - lse[..., rows, None]).to(q.dtype)
                ds = p * (do @ vc.transpose(-2, -1) - delta[..., rows, None])
                dq[..., rows, :] += (ds @ kc) * scale
                dk, dv = (dk_own, dv_own) if step == 0 else acc
                dk[..., cols, :] += (ds.transpose(-2, -1) @ qr) * scale
                dv[..., cols, :] += p.transpose(-2, -1) @ do
                STATS.add("backward", blocks_computed=1, work_pairs=p.numel())
            STATS.add("backward", compute_s=time.perf_counter() - t0)
            if step >= 1:  # pass block src's accumulator on: after the last step it reaches its owner
                travelling = _exchange(acc, group, _DKV_TAG, "backward")
            if pending:
                kv, works = pending
                _wait(works)
        if w > 1:
            (dk_home, dv_home), works = travelling
            _wait(works)
            dk_own, dv_own = dk_own + dk_home, dv_own + dv_home
        return dq, dk_own, dv_own, None, None, None


def ring_attention(q, k, v, group, causal: bool = True, layout: str = "zigzag"):
    """Exact (causal) attention over the whole sequence for this rank's queries; q, k, v: (batch, heads, s / W,
    head_dim), this rank's positions under ``layout``. Differentiable: backward passes K/V and dK/dV round the ring."""
    return _RingAttention.apply(q, k, v, group, causal, layout)


# ---------------------------------------------------------------------------------------------- Ulysses


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` over equal chunks of dim 0 (chunk i to rank i); its backward is the same exchange."""

    @staticmethod
    def forward(ctx, x, group, phase):
        ctx.group = group
        return _all_to_all(x, group, phase)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.group, "backward"), None, None


def _all_to_all(x, group, phase: str):
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    w = dist.get_world_size(group)
    n = x.numel() * x.element_size() * (w - 1) // w  # the chunk a rank keeps is not sent
    STATS.add(phase, sent_bytes=n, recv_bytes=n)
    return out


def ulysses_attention(q, k, v, group, causal: bool = True, layout: str = "contiguous", attention: str = "math"):
    """DeepSpeed-Ulysses: all-to-all so that this rank holds every position of ``heads / W`` heads, attention over
    the whole sequence (the GPT's own ``attention_core``), all-to-all back. q, k, v: (batch, heads, s / W, head_dim)."""
    me, w = dist.get_rank(group), dist.get_world_size(group)
    b, h, n, d = q.shape
    if h % w:
        raise ValueError(f"Ulysses gives each of the {w} CP ranks heads / CP whole heads: {h} heads do not split "
                         f"over {w} (CP may be at most the heads, and must divide them)")
    order = torch.argsort(torch.cat([layout_indices(layout, n * w, w, r) for r in range(w)])).to(q.device)

    def scatter_heads(t):  # (b, h, n, d) -> (b, h / W, s, d): chunk i of the heads to rank i, every rank's positions
        t = _AllToAll.apply(t.reshape(b, w, h // w, n, d).transpose(0, 1), group, "forward")
        return t.permute(1, 2, 0, 3, 4).reshape(b, h // w, w * n, d).index_select(2, order)

    q, k, v = (scatter_heads(t) for t in (q, k, v))
    t0 = time.perf_counter()
    y = attention_core(q, k, v, attention) if causal else F.scaled_dot_product_attention(q, k, v)
    STATS.add("forward", blocks_computed=1, work_pairs=b * (h // w) * (n * w) ** 2,
              compute_s=time.perf_counter() - t0)
    y = y.index_select(2, torch.argsort(order))  # back to the ranks' order of positions
    y = _AllToAll.apply(y.reshape(b, h // w, w, n, d).permute(2, 0, 1, 3, 4), group, "forward")
    return y.transpose(0, 1).reshape(b, h, n, d)  # every head of this rank's positions


# ---------------------------------------------------------------------------------------------- the GPT


def gpt_forward(model, idx, positions, targets, attend):
    """The course GPT's forward (:class:`helpers.rank.gpt.GPT`) on this rank's positions of each sequence: the same
    modules and weights, positions from the layout rather than ``arange``, and the attention core replaced by
    ``attend(q, k, v)``. Returns (logits, mean loss over this rank's tokens)."""
    x = model.tok_emb(idx) + model.pos_emb(positions)
    for block in model.blocks:
        a, h = block.attn, block.ln1(x)
        b, n, _ = h.shape
        q, k, v = (lin(h).view(b, n, -1, a.head_dim).transpose(1, 2) for lin in (a.q, a.k, a.v))
        x = x + a.proj(attend(q, k, v).transpose(1, 2).reshape(b, n, -1))
        x = x + block.mlp(block.ln2(x))
    logits = model.head(model.ln_f(x))
    wide = torch.promote_types(logits.dtype, torch.float32)
    return logits, F.cross_entropy(logits.flatten(0, 1).to(wide), targets.flatten())


def forward_activation_bytes(model, forward) -> int:
    """What MemTracker (``torch.distributed._tools.mem_tracker``, chapter 08's tool) labels activations on this rank
    right after ``forward()`` has run, the model's parameters tracked as such: everything the forward keeps for the
    backward, plus its outputs. ``forward`` should make its own inputs (this rank's token ids), so they count too;
    nothing is backpropagated. (Without the tracker there are no such cycles: training frees each block on time.)"""
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        kept = forward()
        gc.collect()  # MemTracker's dispatch mode leaves reference cycles around c10d's p2p calls, which hold the
        # ring's received blocks until the collector runs. And gloo's worker thread lets go of a collective's
        # buffers a moment after the call has returned: with ranks sharing cores, that moment can come after the
        # forward ends (one Ulysses run here read one all-to-all buffer more on one rank). Nothing allocates
        # while this waits, so the settled count is the lowest of reads 10 ms apart.
        reads = []
        for _ in range(SETTLE_READS):
            reads.append(sum(device[_MemRefType.ACT] for device in tracker.get_tracker_snapshot("current").values()))
            time.sleep(0.01)
    del kept
    return min(reads)


def flat_grads(model) -> torch.Tensor:
    """Every parameter's gradient in one vector (parameter order), for comparing two models' gradients."""
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def torch_context_parallel(cp_mesh, device) -> bool:
    """``--attn torch``: torch's own ``context_parallel`` (torch.distributed.tensor.experimental) on one causal SDPA
    call first. It has sharding strategies for SDPA's CUDA kernels only; on CPU the call reaches
    ``_scaled_dot_product_flash_attention_for_cpu`` and fails deep in DTensor's dispatch: stop with that reason. Where
    it runs (CUDA), True: train through :func:`torch_cp_backward`."""
    from torch.distributed.tensor.experimental import context_parallel

    q = torch.randn(1, 1, 2 * cp_mesh.size(), 8, device=device)
    try:
        with context_parallel(cp_mesh, buffers=[q], buffer_seq_dims=[2], no_restore_buffers={q}):
            F.scaled_dot_product_attention(q, q, q, is_causal=True)
    except NotImplementedError as e:
        kernel = re.search(r"aten\.\S+", str(e))
        raise RuntimeError(f"--attn torch: torch.distributed.tensor.experimental.context_parallel shards only SDPA's "
                           f"CUDA kernels (flash / memory-efficient / cuDNN); on {device.type} causal SDPA runs "
                           f"{kernel.group(0) if kernel else 'its math kernel'}, for which it has no sharding "
                           f"strategy ({type(e).__name__}). "
                           f"Use --attn ring or --attn ulysses on CPU.") from e
    return True


def torch_cp_backward(model, x, y, cp_mesh) -> torch.Tensor:
    """One forward and backward of the course GPT under torch's ``context_parallel`` (GPUs only: see
    :func:`torch_context_parallel`). It shards the token ids, the targets and the positions along the sequence in
    place (its load balancer gives each rank an early and a late chunk, as zig-zag does) and runs every causal SDPA
    call as its own ring; this rank's share of the loss is backpropagated inside the context, as torch requires.
    Returns this rank's mean loss. (Written to torch's documented use; this course's CPU machines cannot run it.)"""
    from torch.distributed.tensor.experimental import context_parallel

    x, y = x.clone(), y.clone()  # sharded in place: keep the caller's batch whole
    pos = torch.arange(x.size(1), device=x.device)
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    with context_parallel(cp_mesh, buffers=[x, y, pos], buffer_seq_dims=[1, 1, 0], no_restore_buffers={x, y, pos}):
        _, loss = gpt_forward(model, x, pos, y, sdpa)
        (loss / cp_mesh.size()).backward()
    return loss


def reference_step(model, x, y, dtype) -> tuple[float, torch.Tensor]:
    """One process, the whole batch unsplit, a copy of ``model`` in ``dtype``: (loss, flat gradients). What a CP
    step must reproduce (in fp32 and fp64: the pair gives the noise floor of fp32 rounding)."""
    twin = copy.deepcopy(model).to(dtype)
    twin.zero_grad(set_to_none=True)
    _, loss = twin(x, y)
    loss.backward()
    return loss.item(), flat_grads(twin)


def parity_check(loss: float, grads: torch.Tensor, refs: dict, run_dtype) -> dict:
    """One CP step's (loss, gradients) against :func:`reference_step` in the run's dtype, with floors from the fp32
    and fp64 references (:mod:`helpers.calc.parity`: K x floor in fp32, the fp64 bound in fp64)."""
    (l32, g32), (l64, g64) = refs[torch.float32], refs[torch.float64]
    ref_loss, ref_grads = refs[run_dtype]
    loss_floor = max(abs(l32 - l64), parity.FP32_EPS * abs(l64))
    grad_floor = max((g32.double() - g64).abs().max().item(), parity.FP32_EPS * g64.abs().max().item())
    bound = (parity.fp64_bound if run_dtype == torch.float64 else (lambda f: parity.K * f))
    loss_gap, grad_gap = abs(loss - ref_loss), (grads - ref_grads).abs().max().item()
    return {"loss_gap": loss_gap, "grad_gap": grad_gap, "loss_floor": loss_floor, "grad_floor": grad_floor,
            "loss_bound": bound(loss_floor), "grad_bound": bound(grad_floor),
            "ok": loss_gap <= bound(loss_floor) and grad_gap <= bound(grad_floor)}
