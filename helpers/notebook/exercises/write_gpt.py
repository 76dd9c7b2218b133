"""The exercises of the GPT memory chapter (08): a layer's activation bytes from the formula, and activation
checkpointing written by hand. Same shape as :mod:`helpers.notebook.exercises.write` (which re-exports the
write-the-code checker, so a notebook calls ``write.check_checkpointing``): the learner's function is launched on
real ranks and compared with the reference, each classic mistake named with a hint.
"""
from __future__ import annotations

import ast

from ...calc import activations
from ..i18n import _
from . import Verdict, _never_raises, _not_a_number, _real_number
from .ranks import PARITY_K, PREAMBLE, function_source, is_stub, launch_problem, parity_bound, run_on_ranks, \
    stub_verdict

PREAMBLE.setdefault("run_blocks", "import torch\nfrom torch.utils.checkpoint import checkpoint\n")


@_never_raises
def check_layer_bytes(answer, *, s: int, b: int, h: int, a: int, dtype: str = "fp32") -> Verdict:
    """How many bytes does one layer of the course's GPT ("math" attention, no checkpointing) keep for backward?
    Within 1% of :func:`helpers.calc.activations.layer_bytes` (which adds LayerNorm statistics and the mask)."""
    value = _real_number(answer)
    if value is None:
        return _not_a_number(answer)
    answer = value  # a Fraction, a numpy scalar or a 0-d tensor, read as a number
    e = activations.DTYPE_BYTES[dtype]
    exact = activations.layer_bytes(s, b, h, a, dtype)
    main = e * (16 * s * b * h + a * s * s * b)
    if abs(answer - exact) <= 0.01 * exact:
        return Verdict(True, _("{answer:.0f} bytes: {e} x (16 s b h + a s^2 b) = {main} (the formula adds "
                               "{small} bytes of LayerNorm statistics and causal mask: {exact:.0f}).",
                               answer=answer, e=e, main=main, small=exact - main, exact=exact))
    wrong = _("{answer:.0f} bytes is not it.", answer=answer)
    if abs(answer - (34 * s * b * h + 5 * a * s * s * b)) <= 0.01 * exact:
        return Verdict(False, wrong, _("That is Korthikanti's fp16 count with dropout. This GPT has no dropout (no "
                                       "masks, the softmax output saved once) and runs in {dtype}: {e} bytes an "
                                       "element.", dtype=dtype, e=e))
    if abs(answer - main / e) <= 0.01 * exact / e:
        return Verdict(False, wrong, _("That is the number of elements; multiply by the bytes of an element "
                                       "({e} in {dtype}).", e=e, dtype=dtype))
    if abs(answer - e * 16 * s * b * h) <= 0.01 * exact:
        return Verdict(False, wrong, _("The s x s softmax output is missing: a s^2 b elements per layer with "
                                       "'math' attention."))
    if a > 1 and abs(answer - e * (16 * s * b * h + s * s * b)) <= 0.01 * exact:
        return Verdict(False, wrong, _("The softmax output is one s x s matrix per head: a s^2 b elements, not "
                                       "s^2 b."))
    if e != 2 and abs(answer - 2 * main / e) <= 0.01 * exact:
        return Verdict(False, wrong, _("That counts 2 bytes an element (fp16 or bf16); this run keeps its "
                                       "activations in {dtype}: {e} bytes an element.", dtype=dtype, e=e))
    return Verdict(False, wrong, _("Count what autograd keeps per layer, in units of s b h elements: two "
                                   "LayerNorm inputs and outputs (4), q, k, v (3), the attention output (1), the "
                                   "GELU's input and output (8); plus the softmax output, a s^2 b; times {e} bytes.",
                                   e=e))


def _reentrant_calls(source: str) -> bool:
    """True if some checkpoint(...) call does not say use_reentrant=False."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "checkpoint":
            kw = {k.arg: k.value for k in node.keywords}
            if not (isinstance(kw.get("use_reentrant"), ast.Constant) and kw["use_reentrant"].value is False):
                return True
    return False


@_never_raises
def check_checkpointing(run_blocks, nproc: int = 2) -> Verdict:
    """Run the learner's ``run_blocks(blocks, x)`` in a DDP GPT on ``nproc`` gloo ranks; check losses and first-step
    gradients against the plain block loop (within K floors of fp32 rounding measured in the same run) and that the
    activations held after the forward dropped to full checkpointing's formula (within 10%)."""
    source = function_source(run_blocks, "run_blocks")
    if is_stub(source, "run_blocks"):
        return stub_verdict()
    outcomes, error = run_on_ranks("checkpointing", source, "run_blocks", nproc)
    reentrant = _("The reentrant version (use_reentrant=True, the old default) re-runs the forward inside its own "
                  "backward, where DDP sees each parameter's gradient arrive twice; it also loses the gradients of "
                  "inputs that do not require grad. Pass use_reentrant=False, as PyTorch recommends.")
    if any("ready only once" in o.get("error", {}).get("message", "") for o in outcomes.values()):
        return Verdict(False, _("DDP saw a parameter's gradient arrive twice in one backward."), reentrant)
    problem = launch_problem(outcomes, error, _("Every rank runs the same blocks; checkpointing adds no "
                                                  "communication."), "run_blocks", source)
    if problem is not None:
        return problem
    tol = 0.10  # held activations vs the formula, as in the chapter
    for rank in sorted(outcomes):
        o = outcomes[rank]
        ref, theirs = o["reference"], o["theirs"]
        floor, tolerance = parity_bound(ref["fp32"]["losses"] + ref["fp32"]["grads"],
                                        ref["fp64"]["losses"] + ref["fp64"]["grads"])
        mine = theirs["losses"] + theirs["grads"]
        gap = max(abs(x - y) for x, y in zip(mine, ref["fp32"]["losses"] + ref["fp32"]["grads"]))
        if gap > tolerance:
            if max(abs(x - y) for x, y in zip(theirs["losses"], o["skipped"])) <= tolerance:
                return Verdict(False, _("the loss is what the model gives with no blocks at all: the blocks' "
                                        "output never reached the head."),
                               _("checkpoint(block, x, use_reentrant=False) returns the block's output: assign it, "
                                 "x = checkpoint(...), and return x at the end."))
            return Verdict(False, _("on rank {rank} the losses or gradients are {gap:.2g} from the plain loop's, more "
                                    "than {k} x the rounding floor {floor:.2g} measured in the same run.",
                                    rank=rank, gap=gap, k=PARITY_K, floor=floor),
                           _("Checkpointing must not change what is computed: run every block once, in order, on "
                             "the previous block's output."))
    o = outcomes[0]
    if _reentrant_calls(source):
        return Verdict(False, _("the numbers are right, but a checkpoint call does not say use_reentrant=False."),
                       reentrant)
    held, full, none = o["act_theirs"], o["formula"]["full"], o["formula"]["none"]
    if abs(held / none - 1) <= tol or held >= 0.9 * o["act_plain"]:
        return Verdict(False, _("the numbers are right, but the forward kept {held} bytes of activations, as many as "
                                "without checkpointing ({plain}).", held=held, plain=o["act_plain"]),
                       _("Wrap each block: x = checkpoint(block, x, use_reentrant=False). Calling block(x) inside "
                         "the loop, or only some blocks, keeps their activations."))
    if held < (1 - tol) * full:
        return Verdict(False, _("the forward kept {held} bytes, fewer than one block input per block ({full:.0f} by "
                                "the formula): the blocks were checkpointed as one unit.", held=held, full=full),
                       _("One checkpoint per block: recomputing the whole stack at once saves a little more "
                         "memory, but backward then holds every block's activations at the same time."))
    if abs(held / full - 1) > tol:
        return Verdict(False, _("the forward kept {held} bytes of activations; full checkpointing's formula says "
                                "{full:.0f}.", held=held, full=full),
                       _("Wrap every block, and nothing else: x = checkpoint(block, x, use_reentrant=False)."))
    return Verdict(True, _("on {nproc} DDP ranks the losses and gradients are the plain loop's (within {k} x the "
                           "rounding floor), and the forward keeps {held} bytes of activations instead of {plain} "
                           "({ratio:.3f} x full checkpointing's formula, {full:.0f}).", nproc=nproc, k=PARITY_K,
                           held=held, plain=o["act_plain"], ratio=held / full, full=full))
