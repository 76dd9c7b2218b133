"""A right answer in another form is still right, and a verdict blames only what the answer did (all in-process).

- Every numeric checker reads its answer with one helper (helpers.notebook.exercises._real_number): a Fraction, a
  numpy scalar, a 0-d tensor or array is a number; a bool, a string or a list is refused with the checker's message.
- A learner's function is shipped to the ranks with the helpers it calls from the same notebook cell.
- An error raised outside the learner's lines is not quoted as theirs.
"""
import linecache
import textwrap
from fractions import Fraction

import numpy as np
import pytest
import torch

from helpers.calc import activations, tp
from helpers.notebook import exercises
from helpers.notebook.exercises import env, faults, fsdp, practice, ranks, write, zero

STEP = dict(compute=[(0, 42), (48, 70), (88, 95)], comm=[(30, 55), (60, 80)])
TP_SIZE = dict(n_layer=2, batch=8, seq_len=1024, d_model=4096, tp_degree=8, bytes_per_element=2)

# checker, its right answer (a whole number where the checker wants one), the words its refusal starts with
NUMERIC = {
    "global batch": (lambda a: exercises.check_global_batch(a, per_rank_batch=32, world_size=4, accumulation=2),
                     256, "expected a whole number"),
    "all-reduce sum": (lambda a: exercises.check_allreduce_sum(a, 4), 10, "expected a whole number"),
    "bus bandwidth": (lambda a: env.check_busbw(a, size_bytes=1e9, seconds=1.0, world_size=8), 1.75,
                      "expected a number of GB/s"),
    "TP bytes": (lambda a: write.check_tp_bytes(a, **TP_SIZE),
                 tp.activation_bytes_per_step(2, 8, 1024, 4096, 8, False, 2), "expected a whole number"),
    "layer bytes": (lambda a: write.check_layer_bytes(a, s=128, b=4, h=256, a=8),
                    activations.layer_bytes(128, 4, 256, 8), "expected a whole number"),
    "bubble": (lambda a: write.check_bubble(a, p=4, m=12), 0.2, "expected a fraction of a step"),
    "exposed": (lambda a: write.check_exposed(a, **STEP), 16, "expected milliseconds"),
    "warmup lr": (lambda a: practice.check_warmup_lr(a, step=5, lr=1e-3, warmup_steps=10), None,
                  "expected a learning rate"),
    "estimator GiB": (lambda a: zero.check_estimator_gib(a, params=7e9, world_size=8), 27.5, "expected a number"),
    "comm multiple": (lambda a: zero.check_comm_multiple(a, stage=2, accumulation=4), 4.5, "expected a number"),
    "resume batch": (lambda a: fsdp.check_resume_batch(a, global_batch=48, old_world_size=2, new_world_size=3), 16,
                     "expected a whole number"),
    "smallest stage": (lambda a: zero.check_smallest_stage(a, params=7e9, world_size=8, budget_gib=80), 1,
                       "expected a stage"),
}


def _right(name):
    check, right, _refusal = NUMERIC[name]
    if right is None:  # the warmup rate: read off the schedule the checker compares with
        from helpers.calc.schedules import deepspeed_warmup_lr
        right = deepspeed_warmup_lr(5, 1e-3, 10)
    return check, right


def _forms(right):
    forms = [Fraction(right).limit_denominator(10 ** 9) if isinstance(right, float) else Fraction(right),
             np.float64(right), np.array(right), torch.tensor(right, dtype=torch.float64)]
    if isinstance(right, int):
        forms += [np.int64(right), torch.tensor(right)]
    return forms


@pytest.mark.parametrize("name", NUMERIC)
def test_a_right_number_in_another_form_passes(name):
    check, right = _right(name)
    assert check(right), check(right)
    for form in _forms(right):
        verdict = check(form)
        assert verdict, (name, repr(form), verdict)


@pytest.mark.parametrize("name", NUMERIC)
def test_what_is_not_a_number_is_refused_with_the_checkers_message(name):
    check, right = _right(name)
    refusal = NUMERIC[name][2]
    for answer in (True, str(right), [right], None, torch.tensor([1.0, 2.0])):
        if answer is None and name == "smallest stage":  # None is an answer there: no stage fits
            continue
        verdict = check(answer)
        assert not verdict and verdict.message.startswith(refusal), (name, answer, verdict)
        assert "could not check" not in verdict.message


def test_a_resume_point_of_fractions_and_tensors_passes():
    assert faults.check_resume_point((Fraction(5), torch.tensor(2)), snapshot_every=5, fault_step=7)
    assert not faults.check_resume_point(("5", 2), snapshot_every=5, fault_step=7)


def test_the_shared_reader_of_numbers():
    read = exercises._real_number
    assert read(Fraction(1, 4)) == 0.25 and read(np.float32(0.5)) == 0.5 and read(torch.tensor(3)) == 3
    assert isinstance(read(np.int64(3)), int) and isinstance(read(torch.tensor(3.0)), float)
    for bad in (True, np.bool_(False), "1", b"1", [1], (1,), {1: 1}, float("nan"), float("inf"), None):
        assert read(bad) is None, bad


# --- the helpers of the learner's cell travel with the function -------------------------------------------------

CELL = '''
import torch
import torch.nn.functional as F

SCALE = 2
SIZES = (3, 4)


class Halver:
    def __call__(self, t):
        return t / SCALE


def _double(t):
    return helper_of_helper(t) * SCALE


def helper_of_helper(t):
    return F.relu(t)


def answer(tensor):
    return Halver()(_double(tensor)) + torch.zeros(SIZES[0])
'''


def _notebook_cell(code: str) -> dict:
    """Run ``code`` as IPython runs a cell: in ``__main__``'s namespace, from a file that exists only in linecache
    (so inspect finds a function's source, but not a class's)."""
    filename = "<ipython-input-7-cell>"
    linecache.cache[filename] = (len(code), None, code.splitlines(keepends=True), filename)
    namespace = {"__name__": "__main__"}
    exec(compile(code, filename, "exec"), namespace)
    return namespace


def test_the_helpers_of_the_cell_travel_with_the_function():
    cell = _notebook_cell(CELL)
    source = ranks.function_source(cell["answer"], "answer")
    for part in ("SCALE = 2", "SIZES = (3, 4)", "class Halver:", "def _double(t):", "def helper_of_helper(t):",
                 "import torch.nn.functional as F", "def answer(tensor):"):
        assert part in source, (part, source)
    shipped = {}
    exec(source, shipped)  # what the rank does with the saved file: every name the function needs is there
    assert torch.equal(shipped["answer"](torch.tensor([-2.0, 2.0, 4.0])), torch.tensor([0.0, 2.0, 4.0]))
    assert ranks.function_source(cell["helper_of_helper"], "helper_of_helper").count("def ") == 1


def test_an_error_in_a_helper_is_placed_in_the_helper():
    source = textwrap.dedent('''
        def helper(t):
            return t.nope

        def ring_all_reduce(tensor):
            helper(tensor)
        ''')
    saved = ranks._prefix("ring_all_reduce") + source
    line = saved.splitlines().index("    return t.nope") + 1
    error = {"type": "AttributeError", "message": "no nope", "line": line, "where": "answer", "world_size": 3}
    verdict = ranks.launch_problem({0: {"error": error}}, None, "hang", "ring_all_reduce", source)
    assert "at line 2 of helper, from your cell" in verdict.message, verdict
    assert "raised by your lines" in verdict.hint, verdict


# --- an error is the learner's only when their lines raised it ------------------------------------------------

RING = "def ring_all_reduce(tensor):\n    dist.send(tensor, 5)\n"


def _problem(**error):
    error = {"type": "ValueError", "message": "boom", "line": None, "where": "answer", **error}
    return ranks.launch_problem({0: {"error": error}, 1: {"error": error}}, None, "hang", "ring_all_reduce", RING)


def test_an_error_raised_by_the_learners_line_is_theirs():
    line = (ranks._prefix("ring_all_reduce") + RING).splitlines().index("    dist.send(tensor, 5)") + 1
    verdict = _problem(line=line)
    assert "at line 2 of your function" in verdict.message and "raised by your lines" in verdict.hint, verdict


def test_an_error_raised_inside_torch_names_torch_and_the_learners_line():
    line = (ranks._prefix("ring_all_reduce") + RING).splitlines().index("    dist.send(tensor, 5)") + 1
    verdict = _problem(line=line, where="torch.distributed.distributed_c10d")
    assert "at line 2 of your function" in verdict.message, verdict
    assert "raised inside torch.distributed.distributed_c10d" in verdict.hint, verdict
    assert "your lines" not in verdict.hint


def test_an_error_raised_outside_the_learners_function_is_not_blamed_on_it():
    for where, said in (("__main__", "the checking task"), ("torch.distributed.pipelining.schedules",
                                                            "torch.distributed.pipelining.schedules")):
        verdict = _problem(where=where)
        assert "raised outside your function" in verdict.message and said in verdict.message, verdict
        assert "your lines" not in verdict.hint and "line" not in verdict.message.split(":")[0], verdict


def test_an_error_only_on_the_rerun_at_fewer_ranks_names_the_rank_count():
    line = (ranks._prefix("ring_all_reduce") + RING).splitlines().index("    dist.send(tensor, 5)") + 1
    verdict = _problem(line=line, where="torch.distributed.distributed_c10d", world_size=1)
    assert "ran through on 2 ranks and failed on 1" in verdict.hint, verdict
