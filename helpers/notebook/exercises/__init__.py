"""Checkers for the notebook exercises: a verdict and, when wrong, a hint that points the way.

Every checker returns a :class:`Verdict` and never raises on a wrong or malformed answer, so a
learner sees a message rather than a traceback. Hints name the idea that is missing; they never
print the expected answer.

The checkers of notebooks 01 and 02 live here; the other chapters' are in the modules beside this one, built on
:class:`Verdict` and :func:`_never_raises`: ``env`` (notebook 00), ``zero`` (03 and 04), ``practice`` (05), ``faults`` (06),
``fsdp`` (07).

Example::

    from helpers.notebook import exercises
    exercises.check_global_batch(64, per_rank_batch=32, world_size=2)
    # Correct: 32 samples per rank x 2 ranks x 1 micro-step = one optimizer step's global batch.
"""
from __future__ import annotations

import ast
import functools
import inspect
import math
import numbers
import textwrap
from dataclasses import dataclass

from .. import i18n
from ..i18n import _


# What a verdict starts with, per language (helpers.notebook.i18n picks the language)
_LABELS = {i18n.ENGLISH: ("Correct: ", "Not yet: ", "Hint: "), i18n.CHINESE: ("正确：", "还不对：", "提示：")}


@dataclass(frozen=True)
class Verdict:
    """The outcome of one check. ``bool(verdict)`` is ``verdict.ok``; printing it shows the message.

    ``message`` and ``hint`` are :func:`helpers.notebook.i18n._` texts: English as strings, shown in the
    kernel's language when printed or displayed, and saved with their msgids so the Chinese build can show a
    saved verdict in Chinese."""

    ok: bool
    message: str
    hint: str = ""

    def render(self, lang: str | None = None) -> str:
        lang = i18n.normalise(lang) if lang else i18n.language()
        right, wrong, hint = _LABELS[lang]
        message = i18n.localized(self.message, lang)
        if self.ok:
            return right + message
        return wrong + message + (f"\n{hint}{i18n.localized(self.hint, lang)}" if self.hint else "")

    def __str__(self) -> str:
        return self.render()

    __repr__ = __str__  # a notebook cell shows the same plain text print() would (stable for nbval)

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(str(self))

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict:
        return {"text/plain": str(self),
                i18n.MIME: {"kind": "verdict", "ok": self.ok, "message": i18n.as_json(self.message),
                            "hint": i18n.as_json(self.hint) if self.hint else None}}

    def __bool__(self) -> bool:
        return self.ok


def render_saved(data: dict, lang: str) -> str:
    """A saved verdict output (its :data:`helpers.notebook.i18n.MIME` payload) as text in ``lang``."""
    return Verdict(data["ok"], _from_json(data["message"]), _from_json(data["hint"]) if data.get("hint") else "").render(lang)


def _from_json(message: dict) -> str:
    return message["msgid"] if message.get("plain") else i18n.Text(message["msgid"], message.get("fields", {}))


def _never_raises(check):
    """A checker that hits something unexpected answers with a Verdict, not a traceback."""
    @functools.wraps(check)
    def wrapper(*args, **kwargs):
        try:
            return check(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - the learner must see a message, never a traceback
            return Verdict(False, _("could not check that answer ({error_type}: {error}).",
                                    error_type=type(e).__name__, error=e),
                           _("Check the type of your answer against the exercise text."))
    return wrapper


def _real_number(answer) -> int | float | None:
    """``answer`` as a finite real number, or None: any ``numbers.Real`` (int, float, ``fractions.Fraction``, a numpy
    scalar) and a one-element tensor or array (its ``.item()``); never a bool, a string or a list. Whole numbers stay
    ``int`` (exact), the rest become ``float`` (what the checkers compare and format). The one reading of a numeric
    answer that every checker shares."""
    one = getattr(answer, "size", None) == 1 or callable(getattr(answer, "numel", None)) and answer.numel() == 1
    if one and callable(getattr(answer, "item", None)):  # a tensor's numel(), an array's size
        answer = answer.item()
    if isinstance(answer, bool) or not isinstance(answer, numbers.Real):
        return None
    if isinstance(answer, numbers.Integral):
        return int(answer)
    value = float(answer)
    return value if math.isfinite(value) else None


def _whole_number(answer) -> int | None:
    """``answer`` as an int if it is a whole number (see :func:`_real_number`), else None."""
    value = _real_number(answer)
    if isinstance(value, float):
        return int(value) if value.is_integer() else None
    return value


def _not_a_number(answer) -> Verdict:
    return Verdict(False, _("expected a whole number, got {answer!r} ({answer_type}).",
                            answer=answer, answer_type=type(answer).__name__),
                   _("Answer with a number such as 12, not a string or a list."))


@_never_raises
def check_global_batch(answer, *, per_rank_batch: int, world_size: int, accumulation: int = 1) -> Verdict:
    """How many samples contribute to one optimizer step across the whole job?

    Example::

        >>> check_global_batch(64, per_rank_batch=32, world_size=2)
        Correct: 32 samples per rank x 2 ranks x 1 micro-step = one optimizer step's global batch.
    """
    value = _whole_number(answer)
    if value is None:
        return _not_a_number(answer)
    right = per_rank_batch * world_size * accumulation
    if value == right:
        if accumulation == 1:
            return Verdict(True, _("{per_rank_batch} samples per rank x {world_size} ranks x {accumulation} "
                                   "micro-step = one optimizer step's global batch.",
                                   per_rank_batch=per_rank_batch, world_size=world_size, accumulation=accumulation))
        return Verdict(True, _("{per_rank_batch} samples per rank x {world_size} ranks x {accumulation} "
                               "micro-steps = one optimizer step's global batch.",
                               per_rank_batch=per_rank_batch, world_size=world_size, accumulation=accumulation))
    wrong = _("{value} is not the global batch.", value=value)
    if value == per_rank_batch:
        if accumulation > 1:
            return Verdict(False, wrong, _("That is what one rank's DataLoader yields. Every rank processes its own "
                                           "batch of that size in the same step, and DDP averages over all of them. "
                                           "Then count the micro-steps of gradient accumulation too."))
        return Verdict(False, wrong, _("That is what one rank's DataLoader yields. Every rank processes its own "
                                       "batch of that size in the same step, and DDP averages over all of them."))
    if accumulation > 1 and value == per_rank_batch * world_size:
        return Verdict(False, wrong, _("You counted the ranks. But with gradient accumulation the optimizer steps "
                                       "only after several micro-batches, and each one adds samples to that step."))
    if world_size > 1 and value == per_rank_batch * accumulation:
        return Verdict(False, wrong, _("You counted gradient accumulation on one rank. Every rank does the same "
                                       "micro-steps on different data, and all of it goes into one step."))
    if world_size > 1 and value in (per_rank_batch // world_size, per_rank_batch * accumulation // world_size):
        return Verdict(False, wrong, _("per_rank_batch is already the batch of ONE rank: it is not split "
                                       "further between ranks, it is multiplied."))
    return Verdict(False, wrong, _("Three factors make the global batch: samples per rank per micro-step, "
                                   "how many ranks, and how many micro-steps before each optimizer step."))


@_never_raises
def check_allreduce_sum(answer, world_size: int) -> Verdict:
    """Every rank contributes ``rank + 1``; what does each rank hold after ``all_reduce(SUM)``?

    Example::

        >>> check_allreduce_sum(3, world_size=2)
        Correct: every rank holds 1 + ... + 2 = 3 after the all-reduce.
    """
    value = _whole_number(answer)
    if value is None:
        return _not_a_number(answer)
    right = world_size * (world_size + 1) // 2
    if value == right:
        return Verdict(True, _("every rank holds 1 + ... + {world_size} = {right} after the all-reduce.",
                               world_size=world_size, right=right))
    wrong = _("{value} is not what the ranks hold.", value=value)
    if value == world_size * (world_size - 1) // 2:
        return Verdict(False, wrong, _("Each rank contributes rank + 1, not its rank: rank 0 adds 1."))
    if value == world_size:
        return Verdict(False, wrong, _("That is the largest contribution (or the number of ranks). SUM adds "
                                       "every rank's value together."))
    if value == 1:
        return Verdict(False, wrong, _("That is rank 0's value before the call. all_reduce works in place, and "
                                       "afterwards every rank holds the same reduced value."))
    if value == right * world_size:
        return Verdict(False, wrong, _("The sum is computed once and every rank receives it; it is not added "
                                       "up again per rank."))
    return Verdict(False, wrong, _("Write down each rank's contribution (rank + 1 for rank 0 .. world_size-1), "
                                   "then add them."))


def _shard(n: int, world_size: int, rank: int, epoch: int, seed: int) -> list[int]:
    from torch.utils.data.distributed import DistributedSampler
    sampler = DistributedSampler(range(n), num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
    sampler.set_epoch(epoch)
    return list(sampler)


def _index_list(answer) -> list[int] | None:
    if hasattr(answer, "tolist") and callable(answer.tolist):
        answer = answer.tolist()
    if isinstance(answer, (str, bytes)) or not hasattr(answer, "__iter__"):
        return None
    out = [_whole_number(a) for a in answer]
    return None if any(a is None for a in out) else out


@_never_raises
def check_shard(answer_indices, *, n: int, world_size: int, rank: int, epoch: int, seed: int = 0) -> Verdict:
    """Which dataset indices does ``rank`` get in ``epoch`` from ``DistributedSampler(shuffle=True, seed=seed)``?

    The answer is compared, in order, with what the real sampler yields after ``set_epoch(epoch)``.

    Example::

        >>> check_shard([0, 1, 2], n=6, world_size=2, rank=0, epoch=0)
        Not yet: [0, 1, 2] is not rank 0's shard in epoch 0.
        Hint: DistributedSampler does not hand out contiguous blocks: ...
    """
    if not (isinstance(world_size, int) and 0 <= rank < world_size and n >= 0 and epoch >= 0):
        return Verdict(False, _("the exercise asked about rank={rank!r}, world_size={world_size!r}, n={n!r}, "
                                "epoch={epoch!r}; that is not a valid setup.",
                                rank=rank, world_size=world_size, n=n, epoch=epoch),
                       _("Use 0 <= rank < world_size."))
    got = _index_list(answer_indices)
    if got is None:
        return Verdict(False, _("expected a list of dataset indices, got {answer!r}.", answer=answer_indices),
                       _("Answer with a list of whole numbers, in the order the rank sees them."))
    right = _shard(n, world_size, rank, epoch, seed)
    if got == right:
        return Verdict(True, _("rank {rank} sees these {count} indices, in this order, in epoch {epoch}.",
                               rank=rank, count=len(right), epoch=epoch))
    wrong = _("{got} is not rank {rank}'s shard in epoch {epoch}.", got=got, rank=rank, epoch=epoch)
    per_rank = len(right)
    total = per_rank * world_size
    for other in range(world_size):
        if other != rank and got == _shard(n, world_size, other, epoch, seed):
            return Verdict(False, wrong, _("That is another rank's shard. Each rank takes every "
                                           "world_size-th entry of the shuffled order, starting at its own rank."))
    for other_epoch in range(epoch + 3):
        if other_epoch != epoch and got == _shard(n, world_size, rank, other_epoch, seed):
            if other_epoch == 0:
                return Verdict(False, wrong, _("That is this rank's shard for a different epoch (the order you get "
                                               "when set_epoch is never called). The shuffle is seeded with "
                                               "seed + epoch, so each epoch has its own order."))
            return Verdict(False, wrong, _("That is this rank's shard for a different epoch. The shuffle "
                                           "is seeded with seed + epoch, so each epoch has its own order."))
    unshuffled = [i % n for i in range(total)][rank:total:world_size] if n else []
    if got == unshuffled:
        return Verdict(False, wrong, _("Right pattern, but shuffle=True: the sampler permutes all indices "
                                       "first (with a generator seeded from seed + epoch), then splits."))
    if got == list(range(rank * per_rank, min(n, (rank + 1) * per_rank))):
        return Verdict(False, wrong, _("DistributedSampler does not hand out contiguous blocks: it shuffles, "
                                       "then gives rank r the entries r, r + world_size, r + 2*world_size, ..."))
    if len(got) == n and world_size > 1:
        return Verdict(False, wrong, _("That is as many indices as the whole dataset; each rank gets only "
                                       "its own part."))
    if len(got) != per_rank:
        if n % world_size:
            return Verdict(False, wrong, _("Each rank gets the same number of indices: n / world_size. With "
                                           "drop_last=False the sampler pads (repeats indices) so that every rank "
                                           "gets the same count: round up, not down."))
        return Verdict(False, wrong, _("Each rank gets the same number of indices: n / world_size."))
    if sorted(got) == sorted(right):
        return Verdict(False, wrong, _("Right indices, wrong order. The DataLoader yields them in the "
                                       "sampler's order, and that order is part of the answer."))
    return Verdict(False, wrong, _("Build DistributedSampler(range(n), num_replicas=..., rank=..., shuffle=True, "
                                   "seed=...), call set_epoch(epoch), then list(...) it."))


def _source(code) -> str:
    if callable(code):
        return textwrap.dedent(inspect.getsource(code))
    if not isinstance(code, str):
        raise TypeError(f"expected source code as a string or a function, got {type(code).__name__}")
    return textwrap.dedent(code)


def _loops_around(tree: ast.AST, target: ast.AST) -> list[ast.For | ast.While]:
    """The for/while loops enclosing ``target``, outermost first."""
    def walk(node, stack):
        if node is target:
            return stack
        inner = stack + [node] if isinstance(node, (ast.For, ast.AsyncFor, ast.While)) else stack
        for child in ast.iter_child_nodes(node):
            found = walk(child, inner)
            if found is not None:
                return found
        return None
    return walk(tree, []) or []


def _iterates_a_loader(loop: ast.AST) -> bool:
    """``for x, y in loader`` / ``enumerate(train_loader)``: a loop over batches, not epochs."""
    return isinstance(loop, (ast.For, ast.AsyncFor)) and "loader" in ast.unparse(loop.iter).lower()


def _set_epoch_problem(tree: ast.AST, call: ast.Call) -> Verdict | None:
    loops = _loops_around(tree, call)
    if not loops:
        return Verdict(False, _("set_epoch is called, but outside any loop: only once."),
                       _("The epoch number changes every epoch, so the call belongs inside the epoch loop."))
    if len(loops) > 1 or _iterates_a_loader(loops[0]):
        return Verdict(False, _("set_epoch is called inside the loop over batches."),
                       _("The order of an epoch is fixed when the DataLoader starts iterating; calling it per "
                         "batch changes nothing for the running epoch. Move it up to the epoch loop."))
    if not call.args and not call.keywords:
        return Verdict(False, _("set_epoch is called without an argument."),
                       _("It needs to know which epoch this is: pass the loop variable."))
    arg = call.args[0] if call.args else call.keywords[0].value
    if isinstance(arg, ast.Constant):
        return Verdict(False, _("set_epoch is always given the same value ({value!r}).", value=arg.value),
                       _("A constant seeds the same shuffle every epoch: pass the epoch loop variable."))
    inner = [n for stmt in loops[0].body for n in ast.walk(stmt)
             if isinstance(n, (ast.For, ast.AsyncFor, ast.While))]
    if inner and min(n.lineno for n in inner) < call.lineno:
        return Verdict(False, _("set_epoch runs after this epoch's batches were already drawn."),
                       _("It takes effect when the DataLoader starts iterating, so the call must come before the "
                         "inner loop; placed after, each epoch uses the order meant for the previous one."))
    return None


@_never_raises
def check_set_epoch(code) -> Verdict:
    """Does this training loop call ``sampler.set_epoch(epoch)`` in the right place?

    ``code`` is the loop's source as a string, or a function whose source is read. The call must be
    inside the epoch loop, before the loop over batches starts, with the epoch as its argument.

    Example::

        >>> check_set_epoch('''
        ... for epoch in range(3):
        ...     sampler.set_epoch(epoch)
        ...     for x, y in loader:
        ...         step(x, y)
        ... ''')
        Correct: set_epoch runs once per epoch, before the batches of that epoch are drawn.
    """
    if not callable(code) and not isinstance(code, str):  # what _source would raise, said in the learner's language
        return Verdict(False, _("could not check that answer (TypeError: expected source code as a string or a "
                                "function, got {answer_type}).", answer_type=type(code).__name__),
                       _("Check the type of your answer against the exercise text."))
    try:
        tree = ast.parse(_source(code))
    except SyntaxError as e:
        return Verdict(False, _("that code does not parse (line {line}: {error}).", line=e.lineno, error=e.msg),
                       _("Paste the whole loop, with its indentation."))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr == "set_epoch"]
    if not calls:
        return Verdict(False, _("this loop never calls set_epoch."),
                       _("Without it the sampler's epoch stays 0, and every epoch shuffles the data into the "
                         "same order. Which sampler method tells it the epoch has changed?"))
    for call in calls:  # a train and a validation sampler: every call must be right
        problem = _set_epoch_problem(tree, call)
        if problem is not None:
            return problem
    return Verdict(True, _("set_epoch runs once per epoch, before the batches of that epoch are drawn."))


@_never_raises
def check_device(answer, *, rank: int, local_rank: int, gpus_per_node: int) -> Verdict:
    """Which GPU does a rank drive? ``answer``: ``"cuda:K"``, ``torch.device("cuda", K)`` or the index ``K``.

    Example::

        >>> check_device("cuda:1", rank=5, local_rank=1, gpus_per_node=4)
        Correct: ...
    """
    text = str(answer).strip().lower()
    if isinstance(answer, bool) or answer is None:
        return Verdict(False, _("expected a device such as 'cuda:0', got {answer!r}.", answer=answer),
                       _("Answer with a string like 'cuda:3' (or the index as a number)."))
    index = _whole_number(answer)
    if index is None:
        if not text.startswith("cuda:") or not text[5:].isdigit():
            return Verdict(False, _("{answer!r} is not a CUDA device.", answer=answer),
                           _("Write it the way torch does: 'cuda:K', where K is the GPU's index on its node."))
        index = int(text[5:])
    if index == local_rank:
        return Verdict(True, _("cuda:{local_rank}: LOCAL_RANK {local_rank} counts the processes on this node, and "
                               "each node numbers its own {gpus_per_node} GPUs from 0. (RANK {rank} is the place "
                               "in the whole job: it names the shard of data and who saves, not the GPU.)",
                               local_rank=local_rank, gpus_per_node=gpus_per_node, rank=rank))
    wrong = _("cuda:{index} is not the GPU this rank drives.", index=index)
    if index == rank:
        hint = _("That is the global RANK. This node has only cuda:0 to cuda:{last}; "
                 "torchrun sets a second variable that counts the processes on this node only.",
                 last=gpus_per_node - 1)
    elif index >= gpus_per_node:
        hint = _("This node has {gpus_per_node} GPUs, numbered from 0: a higher index does not exist here.",
                 gpus_per_node=gpus_per_node)
    else:
        hint = _("Every process on a node drives the GPU whose index is its place on that node.")
    return Verdict(False, wrong, hint)
