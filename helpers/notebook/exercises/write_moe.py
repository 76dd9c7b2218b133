"""The exercises of the expert-parallel chapter (13): the dispatch and combine of an MoE layer written by hand, and
the bytes of a dispatch. Same shape as :mod:`helpers.notebook.exercises.write`, which re-exports them (a notebook
calls ``write.check_dispatch``).

The learner's ``dispatch_combine(rows, expert, n_experts, run_experts, group)`` runs inside a real process group of
``nproc + 1`` ranks, then ``nproc`` (:mod:`helpers.rank.exercises.moe_dispatch`): every rank's rows must come back
through their experts, in token order, with 0 for a dropped row, and their gradient must be one process's. The
experts run only where they live (``run_experts`` gives 0 for a row whose expert is on another rank and counts it),
so an answer that sends nothing cannot pass. What each rank saw tells the classic mistakes apart: no counts
exchanged, rows sent in token order rather than grouped by expert, outputs not put back in token order, a dropped
row sent or given a gradient, an exchange autograd cannot see through.
"""
from __future__ import annotations

from ...calc import moe as moe_calc
from ..i18n import _
from . import Verdict, _never_raises, _not_a_number, _real_number
from .ranks import (PREAMBLE, by_world, function_source, is_stub, launch_problem, one_count_hint, run_on_ranks,
                    stub_verdict)

PREAMBLE.setdefault("dispatch_combine", "import torch\nimport torch.distributed as dist\n"
                                        "from helpers.rank.moe import all_to_all_rows\n")
TOLERANCE = 1e-9  # float64 rows through the same arithmetic: equal but for the order of additions

NO_COUNTS = _("Exchange the counts first: a rank cannot know how many rows it will receive from each rank until "
              "they tell it. All-to-all the per-expert counts (torch.bincount(..., minlength=n_experts)), then use "
              "them as the output split sizes of the rows' all_to_all_single.")
ORDER = _("all_to_all_single sends consecutive chunks: chunk i goes to rank i. Sort the kept rows by expert "
          "(torch.argsort(expert, stable=True)) before sending, so each rank's rows are one chunk, and give "
          "run_experts the expert id of every row that arrived.")
UNPERMUTE = _("The outputs came back in the order they were sent (grouped by expert). Put each one back in its "
              "token's row: out[order] = back, or zeros.index_add(0, order, back).")
DROPPED = _("A dropped row (expert -1) goes to no expert: leave it out of the counts and of the rows you send, and "
            "return 0 for it. Its residual connection carries the token past the layer.")
DROPPED_GRAD = _("A dropped row's output is 0 whatever the row holds, so its gradient must be 0 too: it must not "
                 "reach any expert.")
NOT_DIFFERENTIABLE = _("dist.all_to_all_single fills its output in place, out of autograd's sight. Send the rows "
                       "and the outputs with all_to_all_rows(x, send, recv, group), whose backward sends each row's "
                       "gradient back to the rank it came from.")
NOTHING_SENT = _("run_experts runs only the experts of this rank. Each row must travel to the rank that holds its "
                 "expert (all_to_all_rows), and its output must travel back.")
CRASHED = _("A rank crashed inside a collective: gloo aborts when the rows a rank sends do not match the sizes the "
            "receiver expects. The receiver learns them only from the counts: all-to-all the per-expert counts "
            "(torch.bincount(..., minlength=n_experts)) first, and use them as the receive sizes.")


def _error_hint(outcomes: dict, launched: int) -> str | None:
    """A hint from how the ranks failed, where that names the mistake (None: keep the general verdict)."""
    errors = [o["error"] for o in outcomes.values() if "error" in o]
    if any(e.get("world_size") and e["world_size"] < launched for e in errors):
        return None  # it failed only on one rank fewer: the general verdict names a fixed rank count
    for e in errors:
        message = e["message"].lower()
        if "bincount" in message and "negative" in message:
            return DROPPED
    if len(outcomes) < launched and all("by peer" in e["message"] for e in errors):
        return CRASHED  # a rank died in a collective without a word; the others lost it
    return None


def _counted(calls: list) -> bool:
    """Whether a collective ran before the rows left: the counts' exchange (the reference makes three calls)."""
    return len(calls) >= 3


def _judge(run: dict) -> tuple[str, str] | None:
    """(what was seen, the hint) for one rank's run, or None when its outputs and gradient are one process's."""
    if "returned" in run:
        return (_("dispatch_combine returned {kind}.", kind=run["returned"]),
                _("Return one output row per input row, in token order: a tensor shaped like rows."))
    h = run["hidden"]
    rows = lambda v: [v[i:i + h] for i in range(0, len(v), h)]  # noqa: E731
    same = lambda a, b: all(abs(x - y) <= TOLERANCE * (1 + abs(y)) for x, y in zip(a, b))  # noqa: E731
    where = dict(world=run["world_size"], rank=run["rank"])
    if run["misrouted"] or len(run["calls"]) < 2:
        seen = _("on {world} ranks, {n} rows reached rank {rank}, which does not hold their expert.",
                 n=run["misrouted"], **where)
        if len(run["calls"]) < 2:  # not even the rows and the outputs travelled
            return seen, NOTHING_SENT
        return seen, ORDER if _counted(run["calls"]) else NO_COUNTS
    if not same(run["out"], run["want"]):
        seen = _("on {world} ranks, rank {rank}'s outputs differ from one process's.", **where)
        got, want = rows(run["out"]), rows(run["want"])
        if _same_multiset(got, want):  # every output there, in another order
            return seen, UNPERMUTE
        if any(abs(x) > TOLERANCE for i in run["dropped"] for x in got[i]):
            return seen, DROPPED
        return seen, ORDER if _counted(run["calls"]) else NO_COUNTS
    if not run.get("differentiable") or run.get("grad") is None:
        return _("the outputs are right, but no gradient reached the rows."), NOT_DIFFERENTIABLE
    if not same(run["grad"], run["want_grad"]):
        seen = _("on {world} ranks, the outputs are right but rank {rank}'s gradient of the rows is not.", **where)
        grads = rows(run["grad"])
        return seen, DROPPED_GRAD if any(abs(x) > TOLERANCE for i in run["dropped"] for x in grads[i]) \
            else NOT_DIFFERENTIABLE
    return None


def _same_multiset(a: list, b: list) -> bool:
    left = list(b)
    for row in a:
        match = next((i for i, r in enumerate(left) if all(abs(x - y) <= TOLERANCE * (1 + abs(y))
                                                           for x, y in zip(row, r))), None)
        if match is None:
            return False
        left.pop(match)
    return True


@_never_raises
def check_dispatch(dispatch_combine, nproc: int = 2) -> Verdict:
    """The learner's ``dispatch_combine(rows, expert, n_experts, run_experts, group)``, on ``nproc + 1`` and
    ``nproc`` real ranks: every rank's outputs and gradient against one process, and the mistake named."""
    source = function_source(dispatch_combine, "dispatch_combine")
    if is_stub(source, "dispatch_combine"):
        return stub_verdict()
    outcomes, error = run_on_ranks("moe_dispatch", source, "dispatch_combine", nproc + 1)
    problem = launch_problem(outcomes, error, _("Every rank must make the same collectives in the same order, with "
                                                "the group it is given: the counts, the rows there, the outputs "
                                                "back."), "dispatch_combine", source)
    if problem is not None:
        hint = _error_hint(outcomes, nproc + 1)
        return Verdict(False, problem.message, hint) if hint else problem
    runs = by_world(outcomes)
    wrong, right = {}, []
    for world, by_rank in sorted(runs.items(), reverse=True):
        for rank, run in sorted(by_rank.items()):
            judged = _judge({**run, "rank": rank})
            if judged is not None:
                wrong.setdefault(world, judged)
        if world not in wrong:
            right.append(world)
    for world, (seen, hint) in wrong.items():
        if right and hint in (ORDER, NO_COUNTS):
            return Verdict(False, seen, one_count_hint(right[0], world))
        return Verdict(False, seen, hint)
    sizes = " and ".join(str(w) for w in sorted(runs))
    return Verdict(True, _("on {sizes} real ranks every rank's rows went to the rank of their expert and came back "
                           "in token order, dropped rows stayed 0, and the outputs and the gradient of the rows are "
                           "one process's.", sizes=sizes))


@_never_raises
def check_dispatch_bytes(answer, *, tokens: int, top_k: int, d_model: int, ep: int, bytes_per_element: int = 2,
                         ) -> Verdict:
    """Bytes one EP rank sends to other ranks in the forward dispatch of one MoE layer under uniform routing:
    :func:`helpers.calc.moe.uniform_bytes_per_layer`, within 1%; each classic slip gets its hint."""
    value = _real_number(answer)
    if value is None:
        return _not_a_number(answer)
    right = moe_calc.uniform_bytes_per_layer(tokens, top_k, d_model, ep, bytes_per_element)["dispatch"]["forward"]
    close = lambda v: v > 0 and abs(value - v) <= 0.01 * v  # noqa: E731
    if close(right):
        return Verdict(True, _("{answer:.4g} bytes: {tokens} tokens x k = {k} rows of h = {h} x {e} bytes, of which "
                               "(W-1)/W go to other ranks.", answer=value, tokens=tokens, k=top_k, h=d_model,
                               e=bytes_per_element))
    wrong = _("{answer:.4g} bytes is not it.", answer=value)
    slips = [(right / top_k, _("Each token goes to k experts: k rows leave for every token, not one.")),
             (right * ep / (ep - 1), _("The rows for this rank's own experts stay here: (W-1)/W of them leave.")),
             (2 * right, _("That is the dispatch and the combine together (or 4 bytes per element). The forward "
                           "dispatch alone sends each kept row once, in bf16.")),
             (right / bytes_per_element, _("That counts elements. Multiply by {e} bytes per element.",
                                           e=bytes_per_element)),
             (4 * right, _("That is the four all-to-alls of a layer (dispatch and combine, forward and backward). "
                           "The question asks for the forward dispatch."))]
    hints = [hint for v, hint in slips if close(v)]
    if hints:
        return Verdict(False, wrong, hints[0])
    return Verdict(False, wrong, _("Count the rows that leave: every token sends k rows of h elements, and under "
                                   "uniform routing (W-1)/W of them go to other ranks."))
