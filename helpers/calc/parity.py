"""How close two loss curves of the same computation must be: a tolerance from a noise floor measured in the run.

Why runs that compute the same thing differ. Float addition is not associative: ``(a + b) + c`` and
``a + (b + c)`` round differently. A distributed fp32 run sums the same gradients in another order (per rank, then
reduced; in buckets; partitioned) than one process does, so in exact arithmetic the two are the same computation,
and in fp32 they differ in the last bits of every step, differences the optimizer (Adam) carries into every later
step, where they grow. A fixed tolerance (1e-4, rel 1e-3) is a guess at how much they grow, true on one machine and
false on the next.

The floor, measured. Run the one-process reference twice, in fp32 and in fp64 (float64 rounds 2**29 times finer,
so beside fp32 it is the exact computation). Their distance, ``max |single_fp32 - single_fp64|`` over the compared
steps, is how large fp32 rounding grows in *this* computation, on *this* machine, for *these* steps: the floor
(:func:`floor`; never below one fp32 unit of the losses' size, the resolution of a recorded fp32 loss).

The bound. Every fp32 ordering lands about a floor away from the exact curve, so by the triangle inequality two of
them lie within ``|distributed - exact| + |single - exact|``, about 2 floors apart. One ordering's drift is not
exactly another's (they are different roundings, amplified by the same steps), so :data:`K` puts a safety factor of
4 on the triangle's 2: ``|distributed_fp32 - single_fp32| <= 8 x floor`` (:func:`check`). A curve further away than
that is not rounding: a different batch, order, update or bug (tests/test_parity.py shows such curves refused).

One pair is a noisy measure. The drift is heavy-tailed (Adam divides by sqrt(v) + eps, so a near-zero gradient
that rounds the other way moves its weight by a whole learning rate): measured on one 2-core CPU, 2-rank curves lay
43 floors from one process where the floor came from the one-process pair alone, and 0.002 floors in another run.
So where a distributed run can also run in fp64, give it its own fp64 twin and take the floor over every pair
(:func:`twin_floor`): then ``|d32 - s32| <= |d32 - d64| + |d64 - s64| + |s64 - s32| <= 2 floors + |d64 - s64|``
holds at every step, and the claim rests on the fp64 runs agreeing (:func:`fp64_bound`), a tight check.

Where there is no fp64 run, the floor is the spread between fp32 orderings that are equal in exact arithmetic
(:func:`spread_floor`), and for the same reason the largest over several pairs: tests/test_ds_script.py holds each
ZeRO stage against the largest spread among one process and the *other* stages (leave one out). DeepSpeed is such a
case: its config offers fp32, bf16 and fp16, and its gradient reduction asserts a dtype of the accelerator's
``supported_dtypes()`` (fp32, bf16, fp16; ``split_half_float_double_sparse`` in ``deepspeed/runtime/engine.py``).
The same :data:`K` applies: a spread is itself one instance of "two orderings apart".

fp64 against fp64 (:func:`fp64_bound`): the same perturbations, each 2**-29 as large, through the same steps; while
they are small the growth is linear in them, so a distributed fp64 run must agree with the fp64 reference within
``K x floor x 2**-29``, around 1e-12 for a floor of 1e-4: derived from the fp32 floor, not tuned.

Pure arithmetic: no torch, no numpy. A curve is a sequence of losses (step 1 first) or a ``{step: loss}`` mapping.

Example::

    f = floor(one_fp32, one_fp64)                 # the reference in fp32 and in fp64
    result = check(ddp_fp32, one_fp32, f)         # {"gap", "floor", "k", "bound", "ratio", "ok"}
    assert result["ok"], describe(result)
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

FP32_EPS = 2.0 ** -23  # spacing of fp32 numbers at 1.0 (torch.finfo(torch.float32).eps)
FP64_EPS = 2.0 ** -52  # the same for fp64
K = 8  # 2 (triangle inequality: two orderings, each about a floor from exact) x 4 (one ordering's drift vs another's)

Curve = Sequence[float] | Mapping[int, float]


def _pairs(curve: Curve, reference: Curve) -> list[tuple[float, float]]:
    """(curve value, reference value) per step. Mappings pair by step (every step of ``curve`` must be in
    ``reference``); sequences must be the same length (a curve cut short is refused, not compared on a prefix)."""
    if isinstance(curve, Mapping) != isinstance(reference, Mapping):
        raise TypeError("compare two sequences or two {step: loss} mappings, not one of each")
    if isinstance(curve, Mapping):
        missing = sorted(set(curve) - set(reference))
        if missing:
            raise ValueError(f"steps {missing} are not in the reference curve")
        return [(curve[s], reference[s]) for s in sorted(curve)]
    if len(curve) != len(reference):
        raise ValueError(f"curves of {len(curve)} and {len(reference)} steps: compare the same steps")
    return list(zip(curve, reference))


def max_gap(curve: Curve, reference: Curve) -> float:
    """The largest ``|curve - reference|`` over the steps of ``curve``."""
    pairs = _pairs(curve, reference)
    if not pairs:
        raise ValueError("no steps to compare")
    return max(abs(a - b) for a, b in pairs)


def _upto(curve: Curve, last: int | None) -> Curve:
    if last is None:
        return curve
    if isinstance(curve, Mapping):
        return {s: v for s, v in curve.items() if s <= last}
    return curve[:last]


def _resolution(curve: Curve) -> float:
    values = curve.values() if isinstance(curve, Mapping) else curve
    return FP32_EPS * max(abs(v) for v in values)


def floor(fp32: Curve, fp64: Curve, *, upto: int | None = None) -> float:
    """The noise floor of fp32 rounding: ``max |fp32 - fp64|`` of the one-process reference over steps 1..``upto``
    (all when None), and at least one fp32 unit of the losses' size (:data:`FP32_EPS` x the largest loss)."""
    a, b = _upto(fp32, upto), _upto(fp64, upto)
    return max(max_gap(a, b), _resolution(b))


def twin_floor(*pairs: tuple[Curve, Curve]) -> float:
    """The floor over several runs, each given as an ``(fp32 curve, its fp64 twin)`` pair: the largest
    :func:`floor` among them (each pair compared on its own steps)."""
    if not pairs:
        raise ValueError("give at least one (fp32, fp64) pair")
    return max(floor(a, b) for a, b in pairs)


def spread_floor(first: Curve, second: Curve, *, upto: int | None = None) -> float:
    """The floor where no fp64 run exists: the spread of two fp32 orderings that are equal in exact arithmetic,
    at least one fp32 unit of the losses' size."""
    a, b = _upto(first, upto), _upto(second, upto)
    return max(max_gap(a, b), _resolution(b))


def fp64_bound(fp32_floor: float, k: float = K) -> float:
    """How far a distributed fp64 run may lie from the one-process fp64 run: the fp32 floor scaled by the ratio of
    the two roundings (2**-29), times ``k``."""
    return k * fp32_floor * FP64_EPS / FP32_EPS


def check(curve: Curve, reference: Curve, floor_: float, k: float = K, *, bound: float | None = None) -> dict:
    """Compare ``curve`` with ``reference`` against ``k x floor_`` (or an explicit ``bound``, e.g.
    :func:`fp64_bound`): ``{"gap", "floor", "k", "bound", "ratio" (gap / floor), "ok"}``."""
    if not floor_ > 0:
        raise ValueError(f"a floor must be positive, got {floor_!r}")
    limit = k * floor_ if bound is None else bound
    gap = max_gap(curve, reference)
    return {"gap": gap, "floor": floor_, "k": k, "bound": limit, "ratio": gap / floor_, "ok": gap <= limit}


def describe(result: dict) -> str:
    """One line for an assertion message or a claim's ``measured=``: the gap, the floor, the bound, the ratio."""
    return (f"max |difference| {result['gap']:.2e} = {result['ratio']:.3g} x the floor {result['floor']:.2e}; "
            f"bound {result['bound']:.2e} ({result['gap'] / result['bound']:.2g} of it)")
