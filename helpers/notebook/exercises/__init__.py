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


@dataclass(frozen=True)
class Verdict:
    """The outcome of one check. ``bool(verdict)`` is ``verdict.ok``; printing it shows the message."""

    ok: bool
    message: str
    hint: str = ""

    def __str__(self) -> str:
        if self.ok:
            return f"Correct: {self.message}"
        return f"Not yet: {self.message}" + (f"\nHint: {self.hint}" if self.hint else "")

    __repr__ = __str__  # a notebook cell shows the same plain text print() would (stable for nbval)

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(str(self))

    def __bool__(self) -> bool:
        return self.ok


def _never_raises(check):
    """A checker that hits something unexpected answers with a Verdict, not a traceback."""
    @functools.wraps(check)
    def wrapper(*args, **kwargs):
        try:
            return check(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - the learner must see a message, never a traceback
            return Verdict(False, f"could not check that answer ({type(e).__name__}: {e}).",
                           "Check the type of your answer against the exercise text.")
    return wrapper


def _whole_number(answer) -> int | None:
    """``answer`` as an int if it is a whole number (int, integral float, 1-element tensor), else None."""
    if hasattr(answer, "numel") and callable(answer.numel) and answer.numel() == 1:
        answer = answer.item()
    if isinstance(answer, bool) or not isinstance(answer, numbers.Real):
        return None
    if isinstance(answer, numbers.Integral):
        return int(answer)
    return int(answer) if math.isfinite(answer) and float(answer).is_integer() else None


def _not_a_number(answer) -> Verdict:
    return Verdict(False, f"expected a whole number, got {answer!r} ({type(answer).__name__}).",
                   "Answer with a number such as 12, not a string or a list.")


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
        return Verdict(True, f"{per_rank_batch} samples per rank x {world_size} ranks x {accumulation} "
                             f"micro-step{'s' if accumulation != 1 else ''} = one optimizer step's global batch.")
    wrong = f"{value} is not the global batch."
    if value == per_rank_batch:
        also = " Then count the micro-steps of gradient accumulation too." if accumulation > 1 else ""
        return Verdict(False, wrong, "That is what one rank's DataLoader yields. Every rank processes its own "
                                     f"batch of that size in the same step, and DDP averages over all of them.{also}")
    if accumulation > 1 and value == per_rank_batch * world_size:
        return Verdict(False, wrong, "You counted the ranks. But with gradient accumulation the optimizer steps "
                                     "only after several micro-batches, and each one adds samples to that step.")
    if world_size > 1 and value == per_rank_batch * accumulation:
        return Verdict(False, wrong, "You counted gradient accumulation on one rank. Every rank does the same "
                                     "micro-steps on different data, and all of it goes into one step.")
    if world_size > 1 and value in (per_rank_batch // world_size, per_rank_batch * accumulation // world_size):
        return Verdict(False, wrong, "per_rank_batch is already the batch of ONE rank: it is not split "
                                     "further between ranks, it is multiplied.")
    return Verdict(False, wrong, "Three factors make the global batch: samples per rank per micro-step, "
                                 "how many ranks, and how many micro-steps before each optimizer step.")


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
        return Verdict(True, f"every rank holds 1 + ... + {world_size} = {right} after the all-reduce.")
    wrong = f"{value} is not what the ranks hold."
    if value == world_size * (world_size - 1) // 2:
        return Verdict(False, wrong, "Each rank contributes rank + 1, not its rank: rank 0 adds 1.")
    if value == world_size:
        return Verdict(False, wrong, "That is the largest contribution (or the number of ranks). SUM adds "
                                     "every rank's value together.")
    if value == 1:
        return Verdict(False, wrong, "That is rank 0's value before the call. all_reduce works in place, and "
                                     "afterwards every rank holds the same reduced value.")
    if value == right * world_size:
        return Verdict(False, wrong, "The sum is computed once and every rank receives it; it is not added "
                                     "up again per rank.")
    return Verdict(False, wrong, "Write down each rank's contribution (rank + 1 for rank 0 .. world_size-1), "
                                 "then add them.")


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
        return Verdict(False, f"the exercise asked about rank={rank!r}, world_size={world_size!r}, n={n!r}, "
                              f"epoch={epoch!r}; that is not a valid setup.", "Use 0 <= rank < world_size.")
    got = _index_list(answer_indices)
    if got is None:
        return Verdict(False, f"expected a list of dataset indices, got {answer_indices!r}.",
                       "Answer with a list of whole numbers, in the order the rank sees them.")
    right = _shard(n, world_size, rank, epoch, seed)
    if got == right:
        return Verdict(True, f"rank {rank} sees these {len(right)} indices, in this order, in epoch {epoch}.")
    wrong = f"{got} is not rank {rank}'s shard in epoch {epoch}."
    per_rank = len(right)
    total = per_rank * world_size
    for other in range(world_size):
        if other != rank and got == _shard(n, world_size, other, epoch, seed):
            return Verdict(False, wrong, "That is another rank's shard. Each rank takes every "
                                         "world_size-th entry of the shuffled order, starting at its own rank.")
    for other_epoch in range(epoch + 3):
        if other_epoch != epoch and got == _shard(n, world_size, rank, other_epoch, seed):
            extra = " (the order you get when set_epoch is never called)" if other_epoch == 0 else ""
            return Verdict(False, wrong, f"That is this rank's shard for a different epoch{extra}. The shuffle "
                                         "is seeded with seed + epoch, so each epoch has its own order.")
    unshuffled = [i % n for i in range(total)][rank:total:world_size] if n else []
    if got == unshuffled:
        return Verdict(False, wrong, "Right pattern, but shuffle=True: the sampler permutes all indices "
                                     "first (with a generator seeded from seed + epoch), then splits.")
    if got == list(range(rank * per_rank, min(n, (rank + 1) * per_rank))):
        return Verdict(False, wrong, "DistributedSampler does not hand out contiguous blocks: it shuffles, "
                                     "then gives rank r the entries r, r + world_size, r + 2*world_size, ...")
    if len(got) == n and world_size > 1:
        return Verdict(False, wrong, "That is as many indices as the whole dataset; each rank gets only "
                                     "its own part.")
    if len(got) != per_rank:
        pad = (" With drop_last=False the sampler pads (repeats indices) so that every rank gets the same "
               "count: round up, not down." if n % world_size else "")
        return Verdict(False, wrong, f"Each rank gets the same number of indices: n / world_size.{pad}")
    if sorted(got) == sorted(right):
        return Verdict(False, wrong, "Right indices, wrong order. The DataLoader yields them in the "
                                     "sampler's order, and that order is part of the answer.")
    return Verdict(False, wrong, "Build DistributedSampler(range(n), num_replicas=..., rank=..., shuffle=True, "
                                 "seed=...), call set_epoch(epoch), then list(...) it.")


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
        return Verdict(False, "set_epoch is called, but outside any loop: only once.",
                       "The epoch number changes every epoch, so the call belongs inside the epoch loop.")
    if len(loops) > 1 or _iterates_a_loader(loops[0]):
        return Verdict(False, "set_epoch is called inside the loop over batches.",
                       "The order of an epoch is fixed when the DataLoader starts iterating; calling it per "
                       "batch changes nothing for the running epoch. Move it up to the epoch loop.")
    if not call.args and not call.keywords:
        return Verdict(False, "set_epoch is called without an argument.",
                       "It needs to know which epoch this is: pass the loop variable.")
    arg = call.args[0] if call.args else call.keywords[0].value
    if isinstance(arg, ast.Constant):
        return Verdict(False, f"set_epoch is always given the same value ({arg.value!r}).",
                       "A constant seeds the same shuffle every epoch: pass the epoch loop variable.")
    inner = [n for stmt in loops[0].body for n in ast.walk(stmt)
             if isinstance(n, (ast.For, ast.AsyncFor, ast.While))]
    if inner and min(n.lineno for n in inner) < call.lineno:
        return Verdict(False, "set_epoch runs after this epoch's batches were already drawn.",
                       "It takes effect when the DataLoader starts iterating, so the call must come before the "
                       "inner loop; placed after, each epoch uses the order meant for the previous one.")
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
    try:
        tree = ast.parse(_source(code))
    except SyntaxError as e:
        return Verdict(False, f"that code does not parse (line {e.lineno}: {e.msg}).",
                       "Paste the whole loop, with its indentation.")
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr == "set_epoch"]
    if not calls:
        return Verdict(False, "this loop never calls set_epoch.",
                       "Without it the sampler's epoch stays 0, and every epoch shuffles the data into the "
                       "same order. Which sampler method tells it the epoch has changed?")
    for call in calls:  # a train and a validation sampler: every call must be right
        problem = _set_epoch_problem(tree, call)
        if problem is not None:
            return problem
    return Verdict(True, "set_epoch runs once per epoch, before the batches of that epoch are drawn.")


@_never_raises
def check_device(answer, *, rank: int, local_rank: int, gpus_per_node: int) -> Verdict:
    """Which GPU does a rank drive? ``answer``: ``"cuda:K"``, ``torch.device("cuda", K)`` or the index ``K``.

    Example::

        >>> check_device("cuda:1", rank=5, local_rank=1, gpus_per_node=4)
        Correct: ...
    """
    text = str(answer).strip().lower()
    if isinstance(answer, bool) or answer is None:
        return Verdict(False, f"expected a device such as 'cuda:0', got {answer!r}.",
                       "Answer with a string like 'cuda:3' (or the index as a number).")
    index = _whole_number(answer)
    if index is None:
        if not text.startswith("cuda:") or not text[5:].isdigit():
            return Verdict(False, f"{answer!r} is not a CUDA device.",
                           "Write it the way torch does: 'cuda:K', where K is the GPU's index on its node.")
        index = int(text[5:])
    if index == local_rank:
        return Verdict(True, f"cuda:{local_rank}: LOCAL_RANK {local_rank} counts the processes on this node, and "
                             f"each node numbers its own {gpus_per_node} GPUs from 0. (RANK {rank} is the place "
                             "in the whole job: it names the shard of data and who saves, not the GPU.)")
    wrong = f"cuda:{index} is not the GPU this rank drives."
    if index == rank:
        hint = (f"That is the global RANK. This node has only cuda:0 to cuda:{gpus_per_node - 1}; "
                "torchrun sets a second variable that counts the processes on this node only.")
    elif index >= gpus_per_node:
        hint = f"This node has {gpus_per_node} GPUs, numbered from 0: a higher index does not exist here."
    else:
        hint = "Every process on a node drives the GPU whose index is its place on that node."
    return Verdict(False, wrong, hint)
