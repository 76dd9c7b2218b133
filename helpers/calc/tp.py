"""Tensor and sequence parallelism's communication, per step, from the model's shape: pure arithmetic that
notebook 09 compares with what ``torch.distributed.tensor.debug.CommDebugMode`` counts in course/gpt_tp.py.

Megatron-LM's plan (Shoeybi et al. 2019, section 3) for one transformer layer on ``tp`` ranks: q/k/v and the MLP's
up projection are column-parallel (each rank holds ``1/tp`` of the output features: whole heads, a slice of the
hidden units), the attention's output projection and the MLP's down projection are row-parallel (each rank holds
the matching ``1/tp`` of the input features and produces a partial sum). Two operators join them:

* ``f`` before each column-parallel region: identity in forward, all-reduce of the input's gradient in backward;
* ``g`` after each row-parallel projection: all-reduce of the partial sums in forward, identity in backward.

So a layer all-reduces ``b x s x h`` activations twice in forward and twice in backward (2 regions x f and g).
Sequence parallelism (Korthikanti et al. 2022) splits the LayerNorms' region along the sequence: ``g`` becomes a
reduce-scatter (each rank keeps ``s / tp`` positions of the sum), ``f`` an all-gather, and backward swaps them: the
same bytes on a ring (an all-reduce is a reduce-scatter then an all-gather), and LayerNorm activations 1/tp as large.

The embedding and head terms depend on the plan. course/gpt_tp.py replicates the token and position embeddings and
the head (the course's vocabulary is a few dozen characters, ``V h`` a few thousand numbers, and ``V`` need not
divide by 3 or 4); then plain TP adds nothing, and under SP:

* forward: one all-gather of ``ln_f``'s output before the replicated head (its backward only keeps this rank's slice:
  no communication);
* backward: one all-gather of the embeddings' gradient (forward only took this rank's slice of the replicated
  embeddings: no communication);
* gradient sync: each sequence-parallel LayerNorm (2 per layer, and ``ln_f``) sees ``s / tp`` positions, so its weight
  and bias gradients are partial sums: one all-reduce of ``h`` numbers for each of the ``2 (2L + 1)`` tensors.

On one rank (``tp == 1``) nothing is sent and DTensor issues no collective: every count is 0.

Example::

    tp_collectives(n_layer=2, tp=2, sp=False)["forward"]    # {"all_reduce": 4}
    tp_collectives(n_layer=2, tp=2, sp=True)["backward"]    # {"all_gather": 5, "reduce_scatter": 4}
"""
from __future__ import annotations

PHASES = ("forward", "backward", "grad_sync")
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")


def tp_collectives(n_layer: int, tp: int, sp: bool) -> dict[str, dict[str, int]]:
    """Collective calls per training step of course/gpt_tp.py's plan, per phase (:data:`PHASES`): ``{phase:
    {collective: calls}}`` with only the collectives that occur (an empty dict: none)."""
    if n_layer < 1 or tp < 1:
        raise ValueError(f"n_layer and tp must be >= 1, got {n_layer}, {tp}")
    if tp == 1:
        return {phase: {} for phase in PHASES}
    regions = 2 * n_layer  # attention and MLP of every layer
    if not sp:
        return {"forward": {"all_reduce": regions}, "backward": {"all_reduce": regions}, "grad_sync": {}}
    return {"forward": {"all_gather": regions + 1, "reduce_scatter": regions},  # + 1: ln_f's output to the head
            "backward": {"all_gather": regions + 1, "reduce_scatter": regions},  # + 1: the embeddings' gradient
            "grad_sync": {"all_reduce": 2 * (regions + 1)}}  # weight and bias of each LayerNorm


def per_layer(tp: int, sp: bool) -> dict[str, dict[str, int]]:
    """The collectives one layer adds (the difference between ``n_layer = 2`` and ``1``): plain TP 2 all-reduces in
    forward and 2 in backward; SP 2 all-gathers and 2 reduce-scatters in each, and 4 small all-reduces."""
    two, one = tp_collectives(2, tp, sp), tp_collectives(1, tp, sp)
    return {p: {c: n - one[p].get(c, 0) for c, n in two[p].items() if n - one[p].get(c, 0)} for p in PHASES}


def activation_elements(batch: int, seq_len: int, d_model: int) -> int:
    """``b x s x h``: the activation one region's all-reduce sums (and its all-gather assembles under SP)."""
    return batch * seq_len * d_model


def ring_bytes_per_rank(collective: str, full_bytes: float, tp: int) -> float:
    """Bytes one rank sends for one collective on a ring of ``tp`` ranks, ``full_bytes`` the size of the whole
    (reduced or gathered) tensor: all-gather and reduce-scatter ``(tp - 1) / tp`` of it, all-reduce twice that."""
    if collective not in COLLECTIVES:
        raise ValueError(f"collective must be one of {COLLECTIVES}, got {collective!r}")
    share = full_bytes * (tp - 1) / tp
    return 2 * share if collective == "all_reduce" else share


def activation_bytes_per_step(n_layer: int, batch: int, seq_len: int, d_model: int, tp: int, sp: bool,
                              bytes_per_element: int = 4) -> float:
    """Bytes one rank sends per step on a ring for the layers' activations (forward and backward, the embedding
    and head terms left out): TP's 4L all-reduces and SP's 4L all-gathers + 4L reduce-scatters are the same number.

        >>> activation_bytes_per_step(2, 8, 48, 96, 2, False) == activation_bytes_per_step(2, 8, 48, 96, 2, True)
        True
    """
    full = activation_elements(batch, seq_len, d_model) * bytes_per_element
    regions = 2 * n_layer
    if not sp:
        return 2 * regions * ring_bytes_per_rank("all_reduce", full, tp)
    return 2 * regions * (ring_bytes_per_rank("all_gather", full, tp) + ring_bytes_per_rank("reduce_scatter", full, tp))


def gloo_bytes_per_step(n_layer: int, batch: int, seq_len: int, d_model: int, tp: int, sp: bool,
                        bytes_per_element: int = 4) -> float:
    """The same on gloo, which builds ``reduce_scatter_tensor`` from an all-reduce of the whole tensor and keeps its
    chunk (pytorch/pytorch#118911, #149869): each reduce-scatter costs an all-reduce, so SP sends 1.5x TP there."""
    full = activation_elements(batch, seq_len, d_model) * bytes_per_element
    regions = 2 * n_layer
    if not sp:
        return 2 * regions * ring_bytes_per_rank("all_reduce", full, tp)
    return 2 * regions * (ring_bytes_per_rank("all_gather", full, tp) + ring_bytes_per_rank("all_reduce", full, tp))


def shard_shape(shape: tuple[int, ...], dim: int | None, tp: int) -> tuple[int, ...]:
    """A parameter's local shape on a rank when ``dim`` is split evenly over ``tp`` ranks (None: replicated).

        >>> shard_shape((384, 96), 0, 4)
        (96, 96)
    """
    if dim is None:
        return tuple(shape)
    if shape[dim] % tp:
        raise ValueError(f"dimension {dim} of {tuple(shape)} does not split over {tp} ranks")
    return tuple(n // tp if i == dim else n for i, n in enumerate(shape))


# which dimension of each GPT parameter course/gpt_tp.py splits (nn.Linear weights are (out, in)):
# column-parallel = output features = dim 0, row-parallel = input features = dim 1; None: replicated
SHARD_DIMS = {"attn.q.weight": 0, "attn.k.weight": 0, "attn.v.weight": 0, "attn.proj.weight": 1,
              "mlp.up.weight": 0, "mlp.down.weight": 1}


def shard_dim(name: str) -> int | None:
    """The split dimension of the GPT parameter ``name`` under course/gpt_tp.py's plan (None: replicated)."""
    return next((d for suffix, d in SHARD_DIMS.items() if name.endswith(suffix)), None)
