"""The exercise of the context-parallel chapter (12): one hop of ring attention written by hand, the causal skip and
the log-sum-exp merge. Same shape as :mod:`helpers.notebook.exercises.write`, which re-exports it (a notebook calls
``write.check_ring_step``).

The learner's ``ring_step(q, k, v, q_pos, k_pos, out, lse)`` is a function of tensors, so the checker first calls it
here, on small probes built to tell the classic mistakes apart (each in float64, against the softmax over every key
merged so far): a merge of two blocks that see the same queries, the same with scores in the hundreds (where
``e^lse`` overflows), a block that only some queries see (zig-zag's second chunk), a block wholly in the future with
NaN keys and values (computing it at all shows), and the first block (``lse = -inf``). A mistake found there is
named without launching anything. An answer that passes them runs inside a real ring on ``nproc + 1`` ranks
(zig-zag) and ``nproc`` ranks (contiguous), :mod:`helpers.rank.exercises.ring_step`, against causal attention of
the whole sequence on one process.
"""
from __future__ import annotations

import math
import traceback

import torch

from ...calc import cp as cp_calc
from ...rank.cp import block_softmax, layout_indices
from ..i18n import _
from . import Verdict, _never_raises, _not_a_number, _real_number
from .ranks import (PARITY_K, PREAMBLE, by_world, function_source, is_stub, launch_problem, one_count_hint,
                    run_on_ranks, stub_verdict)

PREAMBLE.setdefault("ring_step", "import torch\nfrom helpers.rank.cp import block_softmax\n")


# ---------------------------------------------------------------------------------------------- the probes


def _qkv(n: int, m: int, seed: int, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, size, 4, generator=g, dtype=torch.float64) for size in (n, m, m))
    return q * scale, k * scale, v  # scores scale by scale^2


def _attend(q, ks, vs, q_pos, k_poss):
    """The softmax over every key of the blocks ``ks`` (at ``k_poss``) that each query sees: (out, lse)."""
    k, v, k_pos = torch.cat(ks, -2), torch.cat(vs, -2), torch.cat(k_poss)
    s = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    s = s.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    lse = torch.logsumexp(s, -1)
    return (torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0) @ v), lse


class _Raised(Exception):
    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


def _call(ring_step, *args):
    """``ring_step(*args)`` on copies (an answer may update ``out`` in place): its (out, lse), or the reason it is not
    that. Raises :class:`_Raised` with the learner's exception."""
    try:
        returned = ring_step(*(a.clone() for a in args))
    except Exception as e:  # noqa: BLE001 - the learner's exception becomes a verdict
        raise _Raised(e) from e
    if not (isinstance(returned, (tuple, list)) and len(returned) == 2
            and all(isinstance(t, torch.Tensor) for t in returned)):
        return type(returned).__name__
    out, lse = returned
    if tuple(out.shape) != tuple(args[0].shape) or tuple(lse.shape) != tuple(args[0].shape[:-1]):
        return f"tensors of shapes {tuple(out.shape)} and {tuple(lse.shape)}"
    return out.detach().double(), lse.detach().double()


def _same(a, b, tolerance: float = 1e-9) -> bool:
    both_inf = torch.isinf(a) & torch.isinf(b) & (torch.sign(a) == torch.sign(b))
    return bool((both_inf | ((a - b).abs() <= tolerance * (1 + b.abs()))).all())


def _probe_verdict(ring_step) -> Verdict | None:
    """Call the answer on the probes; the verdict for the first classic mistake it makes, or None (all right)."""
    pos = lambda *p: torch.tensor(p)  # noqa: E731
    # zig-zag on 3 ranks, 12 positions: rank 1 holds chunks 1 and 4 (2, 3, 8, 9); rank 0 holds 0, 1, 10, 11
    q_pos, own, first_chunk, between, future = pos(2, 3, 8, 9), pos(2, 3, 8, 9), pos(0, 1, 10, 11), pos(4, 5, 6, 7), \
        pos(12, 13, 14, 15)
    q, k1, v1 = _qkv(4, 4, 1)
    k2, v2 = _qkv(4, 4, 2)[1:]
    start = (torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype))

    # 1. the first block: lse = -inf, out = 0 -> the block's own softmax
    got = _call(ring_step, q, k1, v1, q_pos, own, *start)
    if isinstance(got, str):
        return Verdict(False, _("ring_step returned {kind}, not (out, lse) shaped like q and like q without its last "
                                "dimension.", kind=got),
                       _("Return the merged pair: return new_out, new_lse (out: batch x heads x n x head_dim, lse: "
                         "batch x heads x n)."))
    want = _attend(q, [k1], [v1], q_pos, [own])
    if torch.isnan(got[0]).any() or torch.isnan(got[1]).any():
        return Verdict(False, _("on the first block (out = 0, lse = -inf everywhere) your result has NaN."),
                       _("With lse = -inf, lse - max(lse, block_lse) is -inf and e^-inf = 0: the merge takes the block "
                         "as it is. A NaN comes from -inf - (-inf) or 0 x inf: subtract the running max "
                         "m = torch.maximum(lse, block_lse), not lse itself."))
    if not (_same(got[0], want[0]) and _same(got[1], want[1])):
        said = _("on the first block (out = 0, lse = -inf everywhere) your result is not that block's causal softmax "
                 "attention.")
        unmasked = _attend(q, [k1], [v1], q_pos, [torch.zeros_like(own)])
        if _same(got[0], unmasked[0], 1e-7):
            return Verdict(False, said, _("It is the attention without the causal mask: query i sees key j only when "
                                          "k_pos[j] <= q_pos[i] (block_softmax applies it for you)."))
        return Verdict(False, said, _("Merging into nothing must give the block itself: its out, and its lse as the "
                                      "new lse."))
    state = want

    # 1b. a first block at other positions (rank 0's chunks 0 and 10 for rank 1's queries): the causal mask alone
    got = _call(ring_step, q, k2, v2, q_pos, first_chunk, *start)
    want = _attend(q, [k2], [v2], q_pos, [first_chunk])
    if not isinstance(got, str) and not (_same(got[0], want[0]) and _same(got[1], want[1])):
        said = _("a first block at positions 0, 1, 10, 11 for queries at 2, 3, 8, 9: every query sees keys 0 and 1, "
                 "none sees 10 or 11; your result differs.")
        if _same(got[0], start[0]) and _same(got[1], start[1]):
            return Verdict(False, said, _("You skipped a block that queries 2, 3, 8 and 9 all see in part (keys 0 "
                                          "and 1). Skip only when every key is after every query: k_pos.min() > "
                                          "q_pos.max()."))
        return Verdict(False, said, _("Mask by positions, not by index in the block: query i sees key j when "
                                      "k_pos[j] <= q_pos[i] (block_softmax does this for you)."))

    # 2. a second block that every query sees in part: the merge itself
    got = _call(ring_step, q, k2, v2, q_pos, first_chunk, *state)
    want = _attend(q, [k1, k2], [v1, v2], q_pos, [own, first_chunk])
    block = block_softmax(q, k2, v2, q_pos, first_chunk)
    if isinstance(got, str) or not _same(got[0], want[0], 1e-7):
        wrong = _("merging a second block, your out differs from the softmax over both blocks' keys.")
        if isinstance(got, str):
            return Verdict(False, wrong, _("Return (out, lse) after every block, shaped as they came in."))
        if _same(got[0], state[0]) and _same(got[1], state[1]):
            return Verdict(False, wrong, _("You skipped a block that queries 2, 3, 8 and 9 all see in part (keys 0 "
                                           "and 1). Skip only when every key is after every query: k_pos.min() > "
                                           "q_pos.max()."))
        if _same(got[0], (state[0] + block[0]) / 2, 1e-7):
            return Verdict(False, wrong, _("You average the two outputs. Each is a softmax over its own keys; the "
                                           "merged one weighs them by their share of the total: e^(lse - new) and "
                                           "e^(block_lse - new), new = log(e^lse + e^block_lse)."))
        if _same(got[0], state[0] + block[0], 1e-7):
            return Verdict(False, wrong, _("You add the two outputs without rescaling. Each is normalised over its "
                                           "own keys: multiply out by e^(lse - new) and the block's by "
                                           "e^(block_lse - new) before adding."))
        if _same(got[0], block[0], 1e-7) or _same(got[0], state[0], 1e-7):
            return Verdict(False, wrong, _("Your out is one of the two blocks' alone: the other block's keys are "
                                           "lost. Keep both, each weighed by e^(its lse - new)."))
        return Verdict(False, wrong, _("out_new = out e^(lse - new) + block_out e^(block_lse - new), with "
                                       "new = log(e^lse + e^block_lse) per query (lse has no head_dim: unsqueeze(-1) "
                                       "to scale out)."))
    if not _same(got[1], want[1], 1e-7):
        return Verdict(False, _("your out is right after two blocks, but the lse you return is not the log-sum-exp "
                                "over both blocks' scores."),
                       _("Return the new lse, log(e^lse + e^block_lse): the next block is merged against it."))

    # 3. the same with scores in the hundreds: e^lse overflows float32 (and float64 past ~709)
    hot = [t.float() for t in _qkv(4, 4, 3, scale=12.0)]
    k4, v4 = (t.float() for t in _qkv(4, 4, 4, scale=12.0)[1:])
    first = _attend(hot[0].double(), [hot[1].double()], [hot[2].double()], q_pos, [own])
    first = tuple(t.float() for t in first)
    got = _call(ring_step, hot[0], k4, v4, q_pos, first_chunk, *first)
    want = _attend(hot[0].double(), [hot[1].double(), k4.double()], [hot[2].double(), v4.double()], q_pos,
                   [own, first_chunk])
    if isinstance(got, str) or not torch.isfinite(got[0]).all() or not _same(got[0], want[0], 1e-3):
        largest = float(first[1].max())
        return Verdict(False, _("with scores in the hundreds (lse up to {largest:.0f}) your merge gives inf, NaN or a "
                                "wrong out in float32: e^{largest:.0f} overflows.", largest=largest),
                       _("Never take e^lse itself. Subtract the running max m = torch.maximum(lse, block_lse) first: "
                         "new = m + log(e^(lse - m) + e^(block_lse - m)) (or torch.logaddexp), every exponent <= 0."))

    # 4. a block that only the second chunk's queries see: skipped wrongly, or masked wrongly
    got = _call(ring_step, q, k2, v2, q_pos, between, *state)
    want = _attend(q, [k1, k2], [v1, v2], q_pos, [own, between])
    if isinstance(got, str) or not (_same(got[0], want[0], 1e-7) and _same(got[1], want[1], 1e-7)):
        wrong = _("a block at positions 4-7 for queries at 2, 3, 8, 9 (zig-zag): queries 8 and 9 see all of it, 2 and "
                  "3 none; your result differs.")
        if not isinstance(got, str) and (torch.isnan(got[0]).any() or torch.isnan(got[1]).any()):
            return Verdict(False, wrong, _("Your result has NaN: queries 2 and 3 see no key of this block, and a "
                                           "softmax over scores that are all -inf is 0/0. Give such rows out 0 and "
                                           "lse -inf (block_softmax does), which the merge weighs by e^-inf = 0."))
        if not isinstance(got, str) and _same(got[0], state[0]) and _same(got[1], state[1]):
            return Verdict(False, wrong, _("You skipped it. A block can be skipped only when every key is after every "
                                           "query: k_pos.min() > q_pos.max(). Under zig-zag a rank's queries are in "
                                           "two chunks, and a block in the future of the first is in the past of the "
                                           "second."))
        return Verdict(False, wrong, _("Mask by positions, not by index in the block: query i sees key j when "
                                       "k_pos[j] <= q_pos[i] (block_softmax does this for you)."))

    # 5. a block wholly in the future, its K and V NaN: nothing of it may be computed
    nan = torch.full_like(k2, float("nan"))
    got = _call(ring_step, q, nan, nan, q_pos, future, *state)
    if isinstance(got, str) or not (_same(got[0], state[0]) and _same(got[1], state[1])):
        return Verdict(False, _("a block at positions 12-15 for queries at 2, 3, 8, 9 (every key after every query, "
                                "its K and V NaN here): your result changed or became NaN: it was computed."),
                       _("Under the causal mask no query sees that block: return (out, lse) unchanged before "
                         "computing anything (k_pos.min() > q_pos.max()). Those blocks are half of the work: "
                         "skipping them is what makes causal ring attention cheaper."))
    return None


def _raised_verdict(error: BaseException, ring_step) -> Verdict:
    """The learner's exception: blamed on their line when their code raised it, else on the call from it."""
    frames = traceback.extract_tb(error.__traceback__)
    mine = [f for f in frames if f.filename == ring_step.__code__.co_filename]
    said = _("ring_step raised {error_type}: {error}", error_type=type(error).__name__, error=error)
    if any("torch/distributed" in f.filename.replace("\\", "/") for f in frames[len(mine and frames[:1]):]):
        return Verdict(False, said, _("ring_step gets its block from the ring: it must not call collectives or send "
                                      "anything (here it is called outside any process group)."))
    if mine and mine[-1] is frames[-1]:
        line = mine[-1].lineno - ring_step.__code__.co_firstlineno + 1
        return Verdict(False, said, _("Read the error: it is raised by line {line} of your function.", line=line))
    if mine:
        return Verdict(False, said, _("It is raised inside {where}, called from line {line} of your function: check "
                                      "the arguments you pass it (shapes: q is batch x heads x n x head_dim, lse "
                                      "batch x heads x n).", where=frames[-1].name,
                                      line=mine[-1].lineno - ring_step.__code__.co_firstlineno + 1))
    return Verdict(False, said, _("Check the types and shapes your function returns."))


# ---------------------------------------------------------------------------------------------- the checker


def _gap(run: dict, key: str) -> tuple[float, float]:
    """(largest gap of the answer from one process's float32 result, PARITY_K x the fp32-vs-fp64 floor)."""
    got, fp32, fp64 = run["answer"][key], run["fp32"][key], run["fp64"][key]
    gap = max(abs(a - b) for a, b in zip(got, fp32))
    floor = max(max(abs(a - b) for a, b in zip(fp32, fp64)), 2 ** -23 * max(abs(b) for b in fp64))
    return gap, PARITY_K * floor


@_never_raises
def check_ring_step(ring_step, nproc: int = 2) -> Verdict:
    """The learner's ``ring_step(q, k, v, q_pos, k_pos, out, lse) -> (out, lse)``: first the probes here (each
    classic mistake named without a launch), then inside a real ring on ``nproc + 1`` ranks (zig-zag) and ``nproc``
    (contiguous) against causal attention on one process, within :data:`PARITY_K` x the fp32-vs-fp64 floor."""
    source = function_source(ring_step, "ring_step")
    if is_stub(source, "ring_step"):
        return stub_verdict()
    if not callable(ring_step):  # the source itself (as the tests give it): defined here after the cell's imports
        namespace: dict = {}
        exec(compile(PREAMBLE["ring_step"] + source, "<your ring_step>", "exec"), namespace)  # noqa: S102
        ring_step = namespace["ring_step"]
    try:
        verdict = _probe_verdict(ring_step)
    except _Raised as raised:
        return _raised_verdict(raised.error, ring_step)
    if verdict is not None:
        return verdict
    outcomes, error = run_on_ranks("ring_step", source, "ring_step", nproc + 1)
    problem = launch_problem(outcomes, error, _("ring_step gets its block from the ring: it must not call "
                                                "collectives or send anything."), "ring_step", source)
    if problem is not None:
        return problem
    runs = by_world(outcomes)
    wrong, right = {}, []
    for world, by_rank in sorted(runs.items()):
        for rank, run in sorted(by_rank.items()):
            if run.get("learner_calls"):
                return Verdict(False, _("on rank {rank} your ring_step called {calls}.", rank=rank,
                                        calls=", ".join(run["learner_calls"])),
                               _("The task passes the K/V blocks round the ring; ring_step only merges the one it "
                                 "is given: no send, receive or collective."))
            if "returned" in run or not run.get("shapes_ok"):
                return Verdict(False, _("inside the ring on {world} ranks ring_step returned {kind}.", world=world,
                                        kind=run.get("returned", _("tensors of other shapes"))),
                               _("Return (out, lse) after every block, shaped as they came in."))
            gaps = [_gap(run, key) for key in ("out", "lse")]
            if any(gap > bound for gap, bound in gaps):
                wrong.setdefault(world, (rank, run["layout"], gaps))
        if world not in wrong:
            right.append(world)
    for world, (rank, layout, gaps) in wrong.items():
        said = _("inside the ring on {world} ranks ({layout}), rank {rank}'s out and lse are off from one process's "
                 "attention by {gap:.2g} (allowed {bound:.2g}).", world=world, layout=layout, rank=rank,
                 gap=max(g for g, _b in gaps), bound=min(b for _g, b in gaps))
        if right:
            return Verdict(False, said, one_count_hint(right[0], world))
        return Verdict(False, said, _("The probes here passed, so compare what differs inside the ring: the blocks "
                                      "arrive in ring order (your own first), with the positions they hold."))
    sizes = " and ".join(f"{w} ({runs[w][0]['layout']})" for w in sorted(runs))
    return Verdict(True, _("the probes pass (the merge, scores in the hundreds, a block half seen, a block wholly in "
                           "the future skipped), and inside a real ring on {sizes} ranks every rank's out and lse "
                           "match causal attention on one process within {k} x the fp32-vs-fp64 floor.", sizes=sizes,
                           k=PARITY_K))


@_never_raises
def check_ring_bytes(answer, *, b: int, s: int, h: int, cp: int, bytes_per_element: int = 2) -> Verdict:
    """Bytes one CP rank sends per layer in the forward pass of ring attention (K and V of every head):
    :func:`helpers.calc.cp.ring_bytes_per_layer`, within 1%; each classic slip gets its hint."""
    value = _real_number(answer)
    if value is None:
        return _not_a_number(answer)
    rates = cp_calc.ring_bytes_per_layer(b, s, h, cp, bytes_per_element)
    right, block = rates["forward"], b * (s // cp) * h * bytes_per_element  # one K (or V) block
    close = lambda v: v > 0 and abs(value - v) <= 0.01 * v  # noqa: E731
    if close(right):
        return Verdict(True, _("{answer:.4g} bytes: K and V, each b x s/W x h x {e} bytes = {block:.4g}, passed on "
                               "W - 1 = {hops} times.", answer=value, e=bytes_per_element, block=block, hops=cp - 1))
    wrong = _("{answer:.4g} bytes is not it.", answer=value)
    slips = [(right / 2, _("That is K or V alone. Both travel round the ring: two blocks per hop.")),
             (2 * cp * block, _("A rank's block travels W - 1 hops, not W: the last hop would bring it home.")),
             (right * cp, _("Each rank holds s / W positions: its K and V blocks are b x (s/W) x h, not the whole "
                            "sequence.")),
             (rates["forward"] + rates["backward"], _("That is forward and backward together. The backward sends K "
                                                       "and V again plus their gradients: twice the forward.")),
             (right / bytes_per_element, _("That counts elements. Multiply by {e} bytes per element.",
                                           e=bytes_per_element)),
             (cp_calc.ulysses_bytes_per_layer(b, s, h, cp, bytes_per_element)["forward"],
              _("That is Ulysses' four all-to-alls. The ring passes K and V blocks, W - 1 hops."))]
    hints = [hint for v, hint in slips if close(v)]
    if len(hints) == 1:
        return Verdict(False, wrong, hints[0])
    if hints:  # in bf16, elements (x 1/2) and one block of the two (x 1/2) give the same number: name both
        return Verdict(False, wrong, _("Two different slips give this number. (1) {first} (2) {second}",
                                       first=hints[0], second=hints[1]))
    return Verdict(False, wrong, _("Per hop a rank sends its current K and V blocks (b x s/W x h each) to the next "
                                   "rank; there are W - 1 hops in the forward pass."))


def positions(layout: str, seq_len: int, world: int) -> list[list[int]]:
    """Which positions each rank holds (for the notebook's picture of the layouts)."""
    return [layout_indices(layout, seq_len, world, r).tolist() for r in range(world)]
