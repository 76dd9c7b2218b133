"""The exercises of the tensor-parallel chapter (09): Megatron's column- and row-parallel linear layers written by
hand (the f and g operators as ``torch.autograd.Function``), and the activation bytes TP sends per step. Same shape
as :mod:`helpers.notebook.exercises.write`, which re-exports them (a notebook calls ``write.check_tp_linears``).
"""
from __future__ import annotations

from ...calc import parity, tp
from ..i18n import _
from . import Verdict, _never_raises, _not_a_number, _real_number
from .ranks import (PARITY_K, PREAMBLE, by_world, function_source, is_stub, launch_problem, one_count_hint,
                    run_on_ranks, stub_verdict)

PREAMBLE.setdefault("column_row_linears", "import torch\nimport torch.distributed as dist\n"
                                          "import torch.nn.functional as F\n")
QUANTITIES = ("y", "x_grad", "w1_grad", "w2_grad")


def _near(a: list[float], b: list[float], tolerance: float) -> bool:
    return len(a) == len(b) and bool(a) and max(abs(x - y) for x, y in zip(a, b)) <= tolerance


def _tolerance(o: dict, key: str) -> float:
    """K x the distance of one process's fp32 numbers from its fp64 ones (at least one fp32 unit of their size)."""
    return PARITY_K * parity.floor(o["fp32"][key], o["fp64"][key])


def _summed(outcomes: dict, key: str) -> list[float]:
    """The ranks' ``key`` added up elementwise: what an all-reduce would have made of them."""
    values = [o["answer"][key] for o in outcomes.values()]
    return [sum(v) for v in zip(*values)] if all(len(v) == len(values[0]) for v in values) else []


@_never_raises
def check_tp_linears(column_row_linears, nproc: int = 2) -> Verdict:
    """Run the learner's ``column_row_linears(x, w1, w2) -> (y, w1_local, w2_local)`` on ``nproc + 1`` ranks, then
    on ``nproc`` (a new process group without the last rank: shards cut for one rank count fail the other), and
    compare the output, the input's gradient and each shard's gradient with two ``nn.Linear`` on one process, within
    :data:`PARITY_K` x the fp32-vs-fp64 floor of each quantity; then the bytes each rank all-reduced with what
    column- then row-parallel needs (a rank that computes the whole layer sends none). Each classic mistake gets
    its hint."""
    source = function_source(column_row_linears, "column_row_linears")
    if is_stub(source, "column_row_linears"):
        return stub_verdict()
    outcomes, error = run_on_ranks("tp_linear", source, "column_row_linears", nproc + 1)
    failed = [o["error"] for o in outcomes.values() if "error" in o]
    if failed and "cannot be multiplied" in failed[0]["message"]:
        return Verdict(False, _("rank 0 stopped: the shapes do not multiply ({error}).", error=failed[0]["message"]),
                       _("Column-parallel splits w1's OUTPUT features: its rows, dim 0 of the (out, in) weight. "
                         "Row-parallel splits w2's INPUT features: its columns, dim 1. Each rank takes its "
                         "torch.tensor_split(..., world, dim)[rank]."))
    problem = launch_problem(outcomes, error, _("Every rank must call the same collectives in the same order: an "
                                                 "all_reduce on one rank waits for all the others."),
                             "column_row_linears", source)
    if problem is not None:
        return problem
    runs = by_world(outcomes)
    verdicts = {world: _tp_verdict(runs[world], world) for world in sorted(runs)}
    right = [world for world, v in verdicts.items() if v is None]
    for world, verdict in verdicts.items():
        if verdict is not None:  # right at the other rank count: written for one count only
            return Verdict(False, verdict.message, one_count_hint(right[0], world)) if right else verdict
    o = runs[min(runs)][0]
    gap = max(max(abs(a - b) for a, b in zip(r["answer"][k], r["fp32"][k])) for world in runs
              for r in runs[world].values() for k in QUANTITIES)
    need = 4 * (o["comm"]["sizes"]["y"] + o["comm"]["sizes"]["x_grad"])
    return Verdict(True, _("on {small} and {large} ranks, y, the gradient of x and of both shards match two nn.Linear "
                           "on one process (largest gap {gap:.1g}, within {k} x the fp32-vs-fp64 floor of each), and "
                           "each rank all-reduced {need} bytes: y forward, x's gradient backward, never a weight.",
                           small=min(runs), large=max(runs), gap=gap, k=PARITY_K, need=need))


def _tp_verdict(outcomes: dict[int, dict], nproc: int) -> Verdict | None:
    """What is wrong with one run of ``nproc`` ranks (None: nothing)."""
    o = outcomes[0]
    if "returned" in o:
        return Verdict(False, _("column_row_linears returned a {kind}, not (y, w1_local, w2_local).",
                                kind=o["returned"]),
                       _("Return the output and the two shards you computed it with: return y, w1_local, w2_local."))
    want1 = tp.shard_shape(tuple(o["shapes"]["w1"]), 0, nproc)
    want2 = tp.shard_shape(tuple(o["shapes"]["w2"]), 1, nproc)
    if tuple(o["w1_local_shape"]) != want1 or tuple(o["w2_local_shape"]) != want2:
        return Verdict(False, _("the shards are {got1} and {got2}; on {nproc} ranks they should be {want1} and "
                                "{want2}.", got1=tuple(o["w1_local_shape"]), got2=tuple(o["w2_local_shape"]),
                                nproc=nproc, want1=want1, want2=want2),
                       _("Column-parallel: each rank keeps 1/N of w1's rows (output features, dim 0); row-parallel: "
                         "1/N of w2's columns (input features, dim 1), the same slice of the hidden units."))
    if not o["leaves"] or not all(_near(r["answer"][k], r["fp32"][k], 0.0) for r in outcomes.values()
                                  for k in ("w1_shard", "w2_shard")):
        return Verdict(False, _("the shards are not this rank's slices of w1 and w2 as leaves that require grad."),
                       _("w1_local = torch.tensor_split(w1, world, 0)[rank].clone().requires_grad_(), and w2's "
                         "columns the same way along dim 1: the optimizer would update these."))
    bad = {k: [rank for rank, r in outcomes.items() if not _near(r["answer"][k], r["fp32"][k], _tolerance(r, k))]
           for k in QUANTITIES}
    if bad["y"]:
        if _near(_summed(outcomes, "y"), o["fp32"]["y"], nproc * _tolerance(o, "y")):
            return Verdict(False, _("y is only this rank's partial sum: added over the ranks it would be right."),
                           _("g's forward must all-reduce the row-parallel layer's partial sums "
                             "(dist.all_reduce on a clone of its input)."))
        return Verdict(False, _("y differs from two nn.Linear on one process (on ranks {ranks}).", ranks=bad["y"]),
                       _("f's forward is the identity: x is already the same on every rank. Only g's forward "
                         "all-reduces, once, after the row-parallel matmul."))
    if bad["w1_grad"] or bad["w2_grad"]:
        twice = all(_near([g / nproc for g in r["answer"]["w2_grad"]], r["fp32"]["w2_grad"], _tolerance(r, "w2_grad"))
                    for r in outcomes.values())
        if twice:
            return Verdict(False, _("the weights' gradients are {nproc} x too large.", nproc=nproc),
                           _("You all-reduce in both directions. g's backward is the identity: the gradient of y is "
                             "already the same on every rank, and summing N copies of it multiplies by N."))
        return Verdict(False, _("the shards' gradients differ from nn.Linear's, sliced to this rank."),
                       _("Compute y from the shards only (w1_local, w2_local), with F.gelu between the two layers."))
    if bad["x_grad"]:
        if _near(_summed(outcomes, "x_grad"), o["fp32"]["x_grad"], nproc * _tolerance(o, "x_grad")):
            return Verdict(False, _("x's gradient is only this rank's share: added over the ranks it would be right."),
                           _("f's backward must all-reduce the gradient: each rank's column shard contributes "
                             "to the gradient of the whole input."))
        return Verdict(False, _("x's gradient differs from nn.Linear's."),
                       _("f: identity forward, all-reduce backward; g: all-reduce forward, identity backward."))
    problem = _communication_problem(o)  # a Verdict is falsy when it fails: no `or` here
    return problem if problem is not None else _probe_problem(outcomes)


def _probe_problem(outcomes: dict[int, dict]) -> Verdict | None:
    """Right numbers and the right all-reduces can still hide the whole layer computed on every rank (collectives of
    the right size that carry nothing): the task ran the answer again on weights whose values outside each rank's
    shards were different random numbers on every rank, and an answer that uses only its shards is not moved."""
    moved = sorted(rank for rank, r in outcomes.items()
                   if not all(_near(r["probe"][k], r["fp32"][k], _tolerance(r, k)) for k in QUANTITIES))
    if not moved:
        return None
    return Verdict(False, _("y and every gradient are right, but when the weights outside each rank's shards were "
                            "replaced by other numbers on every rank, they changed (on ranks {ranks}): the answer "
                            "reads more of w1 and w2 than its shards.", ranks=moved),
                   _("Each rank holds and uses only its shards: y_partial = gelu(x w1_local^T) w2_local^T, and the "
                     "sum over ranks comes from g's all-reduce of those partial outputs, not from the full weights."))


def _communication_problem(o: dict) -> Verdict | None:
    """Right numbers can still come from the whole layer on every rank: what rank 0 sent must be what column- then
    row-parallel sends, one all-reduce of y (g's forward) and one of x's gradient (f's backward), in float32."""
    comm, sizes = o["comm"], o["comm"]["sizes"]
    calls = [(phase, op, n, size) for phase in ("forward", "backward") for op, n, size in comm[phase]
             if op not in ("barrier", "monitored_barrier")]
    need = {"forward": [4 * sizes["y"]], "backward": [4 * sizes["x_grad"]]}
    sent = sum(size for _phase, _op, _n, size in calls)
    if not calls:
        return Verdict(False, _("y and every gradient are right, but the ranks exchanged nothing: each rank computed "
                                "the whole layer from the full weights, where column- and row-parallel all-reduce "
                                "{need} bytes per rank.", need=sum(map(sum, need.values()))),
                       _("Each rank holds and uses only its shards: y_partial = gelu(x w1_local^T) w2_local^T, then "
                         "g sums the ranks' partial outputs (all_reduce in its forward) and f sums the input's "
                         "gradient (all_reduce in its backward)."))
    others = sorted({op for _phase, op, _n, _size in calls if op != "allreduce"})
    if others:
        return Verdict(False, _("y and every gradient are right, but the ranks also ran {ops}: {sent} bytes per rank "
                                "where the two all-reduces need {need}.", ops=", ".join(others), sent=sent,
                                need=sum(map(sum, need.values()))),
                       _("In tensor parallelism only activations cross between ranks, never weights: each rank keeps "
                         "its shards, and g's forward and f's backward each all-reduce once."))
    got = {phase: [size for ph, _op, _n, size in calls if ph == phase] for phase in ("forward", "backward")}
    if got != need:
        return Verdict(False, _("y and every gradient are right, but a rank all-reduced {forward} bytes in the "
                                "forward and {backward} in the backward; column- and row-parallel need {need_forward} "
                                "(y, once) and {need_backward} (x's gradient, once).",
                                forward=sum(got["forward"]), backward=sum(got["backward"]),
                                need_forward=need["forward"][0], need_backward=need["backward"][0]),
                       _("f: identity forward, all-reduce backward; g: all-reduce forward, identity backward. One "
                         "all-reduce each way, of the activation (or its gradient), in float32."))
    return None


@_never_raises
def check_tp_bytes(answer, *, n_layer: int, batch: int, seq_len: int, d_model: int, tp_degree: int,
                   bytes_per_element: int = 2) -> Verdict:
    """Bytes one rank sends per training step for the layers' activations under plain TP on a ring (NCCL's
    all-reduce): :func:`helpers.calc.tp.activation_bytes_per_step`, within 1%."""
    value = _real_number(answer)
    if value is None:
        return _not_a_number(answer)
    answer = value  # a Fraction, a numpy scalar or a 0-d tensor, read as a number
    right = tp.activation_bytes_per_step(n_layer, batch, seq_len, d_model, tp_degree, False, bytes_per_element)
    full = tp.activation_elements(batch, seq_len, d_model) * bytes_per_element
    close = lambda value: abs(answer - value) <= 0.01 * value  # noqa: E731
    if close(right):
        return Verdict(True, _("{answer:.4g} bytes: 4 all-reduces per layer (2 forward, 2 backward) x {n_layer} "
                               "layers x 2 (N-1)/N x b s h x {e} bytes.", answer=answer, n_layer=n_layer,
                               e=bytes_per_element))
    wrong = _("{answer:.4g} bytes is not it.", answer=answer)
    if close(right / 2):
        return Verdict(False, wrong, _("That is the forward pass only. f's backward all-reduces too: two more per "
                                       "layer."))
    if close(4 * n_layer * full) or close(4 * n_layer * full * (tp_degree - 1) / tp_degree):
        return Verdict(False, wrong, _("A ring all-reduce sends 2 (N-1)/N of the tensor per rank: a reduce-scatter "
                                       "and an all-gather, each (N-1)/N."))
    if close(right / n_layer):
        return Verdict(False, wrong, _("That is one layer; every layer has its two regions."))
    return Verdict(False, wrong, _("Per layer: 2 regions (attention, MLP) x (g in forward + f in backward) = 4 "
                                   "all-reduces of b x s x h elements; each sends 2 (N-1)/N of them per rank."))
