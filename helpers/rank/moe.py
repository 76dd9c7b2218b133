"""Mixture of experts inside a rank: the course GPT's feed-forward block replaced by E experts (each the GPT's own
:class:`~helpers.rank.gpt.MLP`) and a router, and expert parallelism: each of W ranks holds E / W of the experts and the
tokens travel to them (notebook 13, course/gpt_moe.py).

* **Router** (Switch / GShard): ``probs = softmax(x W_r)`` over the E experts, each token goes to its top-k experts,
  weighted by their probabilities (the gates; not renormalised).
* **Capacity**: an expert takes at most ``C = ceil(capacity_factor x T x k / E)`` of a group's ``T`` tokens (T k
  assignments). First choices are served before second ones, in token order (GShard); an assignment over capacity is
  dropped: it adds 0 to the token's output, and the residual connection carries the token past the block.
* **Load-balancing loss** (Switch Transformer, eq. 4; GShard): ``aux = E x sum_e f_e P_e``, ``f_e`` the fraction of
  the group's T k assignments that chose expert e (before dropping; not differentiable), ``P_e`` the mean router
  probability of e. Uniform routing gives 1; everything on one expert gives E. Averaged over the groups.
* **Groups**: capacity and the auxiliary loss are per group of tokens. Under expert parallelism a group is one rank's
  tokens; the one-process MoE with ``groups = W`` computes exactly what W ranks compute (the parity reference).
* **Expert parallelism** (:func:`MoE.forward` with a process group): the kept assignments sorted by destination
  expert; an ``all_to_all_single`` of the per-expert counts (each rank learns how many rows it will receive), then one
  of the tokens with uneven splits (dispatch); the local experts run; the reverse all-to-all brings the outputs home
  (combine), where they are weighted by the gates and summed into token order. Backward runs the two exchanges in
  reverse (:class:`_AllToAllV`).

Every exchange counts what this rank sent to other ranks in :data:`STATS` (bytes per phase, tokens per expert,
dropped assignments), read by the script and compared with :mod:`helpers.calc.moe`.

Example (one process; x: (batch, seq, d_model))::

    layer = MoE(d_model=96, experts=4, top_k=2, capacity_factor=1.25)
    y = layer(x); loss = task_loss + 0.01 * layer.aux_loss
"""
from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .cp import flat_grads, parity_check  # noqa: F401  (re-exported: the same parity rule as chapter 12)
from .gpt import MLP

EXCHANGES = ("dispatch", "combine")
PHASES = ("forward", "backward")


# ---------------------------------------------------------------------------------------------- counters


class MoEStats:
    """What this rank's MoE layers did: ``sent_bytes[exchange][phase]`` (token rows sent to OTHER ranks, bytes),
    ``count_bytes`` (the per-expert counts exchanged before each dispatch), ``routed`` (assignments per expert, this
    rank's tokens, before dropping), ``processed`` ({expert id: rows its expert computed on this rank}), ``dropped``
    (assignments over capacity), ``rows`` ({"sent", "received"}: token rows to / from other ranks in the forward
    dispatch, from the exchanged counts), summed over layers and calls."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:  # the script resets after its parity probe: the training steps only
        self.sent_bytes = {x: dict.fromkeys(PHASES, 0) for x in EXCHANGES}
        self.count_bytes, self.routed, self.processed, self.dropped = 0, None, {}, 0
        self.rows = {"sent": 0, "received": 0}  # token rows to / from OTHER ranks in the forward dispatch

    def add_routing(self, routed: torch.Tensor, dropped: int) -> None:
        routed = routed.tolist()
        self.routed = routed if self.routed is None else [a + b for a, b in zip(self.routed, routed)]
        self.dropped += dropped

    def per_step(self, steps: int) -> dict:
        """The counts divided by ``steps`` (what one training step did, every layer)."""
        return {"sent_bytes": {x: {p: v / steps for p, v in d.items()} for x, d in self.sent_bytes.items()},
                "count_bytes": self.count_bytes / steps,
                "tokens_per_expert": [v / steps for v in self.routed or []],
                "processed": {str(e): v / steps for e, v in self.processed.items()}, "dropped": self.dropped / steps,
                "rows": {k: v / steps for k, v in self.rows.items()}}


STATS = MoEStats()


# ---------------------------------------------------------------------------------------------- the exchange


def _exchange(x, send: list[int], recv: list[int], group, exchange: str, phase: str):
    """``all_to_all_single`` with uneven splits: rows ``send[i]`` of ``x`` (in order) to rank i, ``recv[i]`` rows
    from rank i. Counts the bytes of the rows that leave this rank."""
    x = x.contiguous()
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send, group=group)
    row = math.prod(x.shape[1:]) * x.element_size()
    STATS.sent_bytes[exchange][phase] += (sum(send) - send[dist.get_rank(group)]) * row
    return out


class _AllToAllV(torch.autograd.Function):
    """The uneven all-to-all through autograd: its backward is the same exchange with the splits swapped (the
    gradient of a row goes back to the rank it came from)."""

    @staticmethod
    def forward(ctx, x, send, recv, group, exchange):
        ctx.send, ctx.recv, ctx.group, ctx.exchange = send, recv, group, exchange
        return _exchange(x, send, recv, group, exchange, "forward")

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.recv, ctx.send, ctx.group, ctx.exchange, "backward"), None, None, None, None


def all_to_all_rows(x, send: list[int], recv: list[int], group=None, exchange: str = "dispatch"):
    """The differentiable uneven all-to-all (what notebook 13's exercise uses): rows ``send[i]`` of ``x`` to rank i,
    ``recv[i]`` rows from rank i; its backward sends each row's gradient back to the rank it came from. torch's own
    ``torch.distributed.nn.functional.all_to_all_single`` does this too, but is deprecated in torch 2.14 (a
    FutureWarning), and its replacement lives in the private ``torch.distributed._functional_collectives``."""
    return _AllToAllV.apply(x, list(send), list(recv), group, exchange)


# ---------------------------------------------------------------------------------------------- routing


def capacity(tokens: int, top_k: int, experts: int, capacity_factor: float) -> int:
    """``ceil(capacity_factor x tokens x top_k / experts)``: the most assignments one expert takes from a group."""
    return math.ceil(capacity_factor * tokens * top_k / experts)


def route(logits: torch.Tensor, top_k: int, capacity_factor: float):
    """One group's routing from its router logits (T, E): ``(probs, gates, experts, keep, routed, aux)``: the softmax
    (T, E), the top-k gates and expert ids (T, k), ``keep`` (T, k) the assignments within capacity (first choices
    before second ones, in token order), ``routed`` (E,) assignments per expert before dropping, and the Switch
    load-balancing loss ``E x sum_e f_e P_e``.

        >>> _, _, ids, keep, routed, aux = route(torch.zeros(4, 2), 1, 1.0)   # ties: every token picks expert 0
        >>> keep[:, 0].tolist(), routed.tolist(), aux.item()
        ([True, True, False, False], [4, 0], 1.0)
    """
    t, e = logits.shape
    probs = logits.softmax(-1)
    gates, ids = probs.topk(top_k, dim=-1)
    flat = ids.t().reshape(-1)  # choice-major: every token's first choice, then every second choice
    onehot = F.one_hot(flat, e)
    position = (onehot.cumsum(0) * onehot).sum(-1) - 1  # how many assignments to the same expert came before
    keep = (position < capacity(t, top_k, e, capacity_factor)).view(top_k, t).t()
    routed = onehot.sum(0)
    aux = e * ((routed.to(probs.dtype) / (t * top_k)) * probs.mean(0)).sum()
    return probs, gates, ids, keep, routed, aux


def _sorted_assignments(ids, keep):
    """The kept assignments as (token, choice, expert), sorted by expert (stable: token order within an expert)."""
    tok, choice = keep.nonzero(as_tuple=True)
    expert = ids[tok, choice]
    order = torch.argsort(expert, stable=True)
    return tok[order], choice[order], expert[order]


# ---------------------------------------------------------------------------------------------- the layer


class MoE(nn.Module):
    """A mixture-of-experts feed-forward block: ``(batch, seq, d_model) -> (batch, seq, d_model)``; after each forward
    ``aux_loss`` holds the load-balancing loss. ``group`` None: every expert here, capacity per ``groups`` equal groups
    of the batch (split along the batch); a process group of W ranks: this rank holds experts ``[r E/W, (r+1) E/W)``
    (``self.experts``, keyed by their global ids) and its own tokens are one group. ``renormalize``: a token's gates
    over its kept assignments rescaled to sum to 1 (DeepSpeed's and Mixtral's top-2; Switch and GShard do not)."""

    def __init__(self, d_model: int, experts: int, top_k: int = 2, capacity_factor: float = 1.25, *, group=None,
                 groups: int = 1, renormalize: bool = False):
        super().__init__()
        if experts % (dist.get_world_size(group) if group is not None else 1) or not 1 <= top_k <= experts:
            raise ValueError(f"{experts} experts, top-{top_k}, over the group: E % W == 0 and k <= E needed")
        self.n_experts, self.top_k, self.capacity_factor, self.group, self.groups = (
            experts, top_k, capacity_factor, group, groups)
        self.router = nn.Linear(d_model, experts, bias=False)
        shape = SimpleNamespace(d_model=d_model)  # the GPT's MLP reads only d_model
        self.experts = nn.ModuleDict({str(e): MLP(shape) for e in range(experts)})
        self.aux_loss = None
        self.renormalize = renormalize  # DeepSpeed's top-2 rule: the kept gates of a token rescaled to sum to 1

    def keep_local(self) -> "MoE":
        """Drop the experts other ranks of ``self.group`` hold (after building all of them the same on every rank)."""
        w, r = dist.get_world_size(self.group), dist.get_rank(self.group)
        per = self.n_experts // w
        self.experts = nn.ModuleDict({k: m for k, m in self.experts.items() if r * per <= int(k) < (r + 1) * per})
        return self

    def _run_experts(self, rows, expert_of_row, ids):
        """Each expert of ``ids`` on its rows (every expert is called, on no rows too: each gets a gradient);
        outputs in the rows' order."""
        order = torch.argsort(expert_of_row, stable=True)
        sizes = torch.bincount(expert_of_row, minlength=max(ids) + 1)[ids].tolist()
        outs = [self.experts[str(e)](chunk) for e, chunk in zip(ids, rows[order].split(sizes))]
        for e, n in zip(ids, sizes):
            STATS.processed[e] = STATS.processed.get(e, 0) + n
        return torch.cat(outs)[torch.argsort(order)]

    def forward(self, x):
        shape = x.shape
        if self.group is None:
            parts = [self._group_forward(g) for g in x.reshape(-1, shape[-1]).chunk(self.groups)]
            self.aux_loss = torch.stack([a for _, a in parts]).mean()
            return torch.cat([y for y, _ in parts]).view(shape)
        y, self.aux_loss = self._group_forward(x.reshape(-1, shape[-1]))
        return y.view(shape)

    def _group_forward(self, x):
        _, gates, ids, keep, routed, aux = route(self.router(x), self.top_k, self.capacity_factor)
        STATS.add_routing(routed, int((~keep).sum()))
        if self.renormalize:
            gates = gates * keep
            gates = gates / gates.sum(-1, keepdim=True).clamp_min(torch.finfo(gates.dtype).eps)
        tok, choice, expert = _sorted_assignments(ids, keep)
        if self.group is None:
            out = self._run_experts(x[tok], expert, list(range(self.n_experts)))
        else:
            out = self._expert_parallel(x[tok], expert)
        return torch.zeros_like(x).index_add(0, tok, out * gates[tok, choice, None]), aux

    def _expert_parallel(self, rows, expert):
        """Rows sorted by destination expert -> the rows computed by their experts, in the same order."""
        w, me, e = dist.get_world_size(self.group), dist.get_rank(self.group), self.n_experts
        per = e // w
        counts = torch.bincount(expert, minlength=e)  # rows for each expert: chunk i is rank i's experts
        incoming = torch.empty_like(counts)
        dist.all_to_all_single(incoming, counts, group=self.group)  # (from rank i, for my expert j) = [i per + j]
        STATS.count_bytes += counts.element_size() * (e - per)
        send, recv = counts.view(w, per).sum(1).tolist(), incoming.view(w, per).sum(1).tolist()
        STATS.rows["sent"] += sum(send) - send[me]
        STATS.rows["received"] += sum(recv) - recv[me]
        arrived = _AllToAllV.apply(rows, send, recv, self.group, "dispatch")  # by source rank, then by expert
        local = torch.arange(me * per, (me + 1) * per, device=rows.device).repeat(w)
        out = self._run_experts(arrived, local.repeat_interleave(incoming), list(range(me * per, (me + 1) * per)))
        return _AllToAllV.apply(out, recv, send, self.group, "combine")


# ---------------------------------------------------------------------------------------------- the GPT


def moeify(model, experts: int, top_k: int, capacity_factor: float, seed: int, *, group=None, groups: int = 1):
    """Replace every block's MLP of the course GPT by an :class:`MoE` (in place; returns the model). Every expert is
    drawn from ``seed`` the way the GPT draws its MLP (up N(0, 0.02), down N(0, 0.02 / sqrt(2 n_layer)), router
    N(0, 0.02)), so each rank builds the same E experts and keeps its own (``group``)."""
    gen = torch.Generator().manual_seed(seed + 1)
    dtype, n_layer = next(model.parameters()).dtype, len(model.blocks)
    for block in model.blocks:
        layer = MoE(model.cfg.d_model, experts, top_k, capacity_factor, group=group, groups=groups)
        with torch.no_grad():
            for name, p in layer.named_parameters():
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("down.weight") else 0.02
                p.copy_(torch.randn(p.shape, generator=gen) * std)
        block.mlp = (layer.keep_local() if group is not None else layer).to(dtype)
    return model.to(next(model.parameters()).device)


def aux_loss(model) -> torch.Tensor:
    """The load-balancing losses of the last forward, summed over the layers."""
    return sum(b.mlp.aux_loss for b in model.blocks)


def is_expert(name: str) -> bool:
    """Whether parameter ``name`` belongs to an expert (held by E/W ranks' worth of EP) rather than the dense part."""
    return ".experts." in name


def grad_norms(model) -> dict:
    """L2 norms of this rank's gradients: ``{"dense": the replicated parameters', "experts": {id: that expert's}}``."""
    dense, experts = 0.0, {}
    for name, p in model.named_parameters():
        sq = p.grad.double().square().sum().item()
        if is_expert(name):
            e = name.split(".experts.")[1].split(".")[0]
            experts[e] = experts.get(e, 0.0) + sq
        else:
            dense += sq
    by_id = sorted(experts.items(), key=lambda item: int(item[0]))
    return {"dense": dense ** 0.5, "experts": {e: v ** 0.5 for e, v in by_id}}


def loss_of(model, x, y, aux_weight: float):
    """The training loss: next-token cross-entropy + ``aux_weight`` x the load-balancing losses."""
    _, ce = model(x, y)
    return ce + aux_weight * aux_loss(model)


def reference_step(model, x, y, aux_weight: float, dtype, names) -> tuple[float, torch.Tensor]:
    """One process on the whole batch, a copy of the one-process ``model`` (all experts, ``groups`` = the ranks) in
    ``dtype``: (loss, the gradients of the parameters ``names``, flattened in that order)."""
    twin = copy.deepcopy(model).to(dtype)
    twin.zero_grad(set_to_none=True)
    loss = loss_of(twin, x, y, aux_weight)
    loss.backward()
    grads = dict(twin.named_parameters())
    return loss.item(), torch.cat([grads[n].grad.flatten() for n in names])


def deepspeed_moe(d_model: int, experts: int, top_k: int = 2, capacity_factor: float = 1.25, ep: int = 1):
    """DeepSpeed's own MoE layer (``deepspeed.moe.layer.MoE``) in the course GPT's shapes: experts that are the GPT's
    MLP, ``ep`` ranks of expert parallelism (its process groups are made on the first forward, from the world
    deepspeed.init_distributed started), tokens over capacity dropped, no random token selection and no sampled
    second expert, so its routing is deterministic like :class:`MoE`'s. Differences that remain: its capacity is
    ``ceil(T / E x factor x k)`` with at least ``min_capacity`` (set to 0 here), its top-2 gates are renormalised to
    sum to 1, and its forward returns ``(output, l_aux, exp_counts)``. On CPU (deepspeed 0.19.8, ``DS_ACCELERATOR=cpu``,
    gloo) its forward and backward ran in one process and on 2 ranks with ``ep=2``; call
    ``dist.destroy_process_group()`` before the rank exits (without it a rank aborted at exit: "terminate called
    without an active exception").

        layer = deepspeed_moe(96, 8, top_k=2, ep=2)
        y, aux, counts = layer(x)                      # x: (batch, seq, 96)
    """
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    return DeepSpeedMoE(hidden_size=d_model, expert=MLP(SimpleNamespace(d_model=d_model)), num_experts=experts,
                        ep_size=ep, k=top_k, capacity_factor=capacity_factor, eval_capacity_factor=capacity_factor,
                        min_capacity=0, drop_tokens=True, use_rts=False, top2_2nd_expert_sampling=False)
