"""helpers.notebook.exercises.fsdp (notebook 07): right answers pass, each kind of wrong answer gets its own hint that
does not give the answer away, and nothing raises. The right answers are worked out here by hand."""
import pytest

from helpers.notebook.exercises import Verdict
from helpers.notebook.exercises import fsdp

# SimpleCNN's layers (weights + biases): conv1 3*32*9 + 32, conv2 32*64*9 + 64, fc1 4096*128 + 128, fc2 128*10 + 10
LAYERS = {"conv1": 896, "conv2": 18_496, "fc1": 524_416, "fc2": 1_290}
GARBAGE = ["conv1", 3, None, [1, 2], {"a": 1}, object(), float("nan")]


def units(budget, answer):
    return fsdp.check_sharding_units(answer, layer_params=LAYERS, budget_params=budget)


# Budget 600 k: everything but fc1 fits with fc1 (545 k total is under 600 k): one unit is the fewest.
# Budget 530 k: fc1 + fc2 = 525.7 k fits, conv1 + conv2 = 19.4 k: two units, [[conv1, conv2], [fc1, fc2]] or
# [[conv1, conv2, fc1]]? conv2 + fc1 = 542.9 k > 530 k, so conv1, conv2 | fc1, fc2 is the only two-unit grouping.
def test_right_groupings_accepted():
    assert units(600_000, [["conv1", "conv2", "fc1", "fc2"]]).ok
    v = units(530_000, [["conv1", "conv2"], ["fc1", "fc2"]])
    assert isinstance(v, Verdict) and v.ok and "2 units" in v.message


@pytest.mark.parametrize("answer, words", [
    ([["conv1", "conv2", "fc1", "fc2"]], "Split the largest unit"),
    ([["conv1"], ["conv2", "fc1"], ["fc2"]], "Split the largest unit"),
    ([["conv1"], ["conv2"], ["fc1"], ["fc2"]], "merge neighbours"),
    ([["conv1", "conv2"], ["fc1"]], "root unit"),
    ([["conv1", "conv2"], ["fc1", "fc2"], ["fc2"]], "exactly one FSDP module"),
    ([["conv2", "conv1"], ["fc1", "fc2"]], "contiguous"),
    ([["conv1", "conv2"], ["fc1", "fc3"]], "The layers are"),
    ([["conv1", "conv2"], [], ["fc1", "fc2"]], "at least one layer"),
])
def test_wrong_groupings_rejected_with_a_hint(answer, words):
    v = units(530_000, answer)
    assert not v.ok and words in v.hint, v
    assert "conv1, conv2 | fc1, fc2" not in str(v) and "[['conv1', 'conv2'], ['fc1', 'fc2']]" not in str(v)


def test_a_layer_larger_than_the_budget_is_explained():
    v = units(100_000, [["conv1", "conv2"], ["fc1"], ["fc2"]])
    assert not v.ok and "smallest unit" in v.hint


@pytest.mark.parametrize("answer", GARBAGE)
def test_malformed_groupings_get_a_message_not_a_traceback(answer):
    v = units(530_000, answer)
    assert isinstance(v, Verdict) and not v.ok and v.hint


def resume(answer, global_batch=48, old=2, new=3):
    return fsdp.check_resume_batch(answer, global_batch=global_batch, old_world_size=old, new_world_size=new)


def test_right_resume_batch_accepted():
    assert resume(16).ok and resume(16.0).ok and resume(12, new=4).ok


@pytest.mark.parametrize("answer, words", [(24, "old per-rank batch"), (48, "per rank"), (8, "global batch")])
def test_wrong_resume_batch_rejected_with_a_hint(answer, words):
    v = resume(answer)
    assert not v.ok and words in v.hint and "16" not in str(v), v


def test_resume_batch_impossible_world_size_says_so():
    v = resume(10, global_batch=50, new=3)
    assert not v.ok and "multiple of the new world size" in v.hint


@pytest.mark.parametrize("answer", GARBAGE)
def test_malformed_resume_batch_gets_a_message(answer):
    v = resume(answer)
    assert isinstance(v, Verdict) and not v.ok and v.hint
