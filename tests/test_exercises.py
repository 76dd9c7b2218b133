"""helpers.notebook.exercises: right answers pass, each kind of wrong answer gets its own hint, nothing raises."""
import doctest

import pytest
import torch
from torch.utils.data.distributed import DistributedSampler

from helpers.notebook import exercises
from helpers.notebook.exercises import (Verdict, check_allreduce_sum, check_device, check_global_batch, check_set_epoch,
                                        check_shard)

GARBAGE = ["sixty-four", None, [1, 2], {"a": 1}, object(), float("nan"), True, 3.5]


def real_shard(n, world_size, rank, epoch, seed=0):
    sampler = DistributedSampler(range(n), num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
    sampler.set_epoch(epoch)
    return list(sampler)


def test_docstring_examples_hold():
    failed, attempted = doctest.testmod(exercises, optionflags=doctest.ELLIPSIS)
    assert attempted >= 4 and failed == 0


def test_verdict_prints_plain_text_and_is_truthy_only_when_ok():
    good, bad = Verdict(True, "fine."), Verdict(False, "wrong.", "think again.")
    assert str(good) == repr(good) == "Correct: fine."
    assert str(bad) == "Not yet: wrong.\nHint: think again."
    assert good and not bad


# --- check_global_batch ----------------------------------------------------------------------


@pytest.mark.parametrize("answer", [256, 256.0, torch.tensor(256)])
def test_global_batch_right_answer_passes(answer):
    assert check_global_batch(answer, per_rank_batch=32, world_size=4, accumulation=2).ok


def test_global_batch_without_accumulation_gets_accumulation_hint():
    v = check_global_batch(128, per_rank_batch=32, world_size=4, accumulation=2)
    assert not v.ok and "accumulation" in v.hint


def test_global_batch_equal_to_per_rank_gets_ranks_hint():
    v = check_global_batch(32, per_rank_batch=32, world_size=4)
    assert not v.ok and "Every rank" in v.hint


def test_global_batch_without_ranks_gets_ranks_hint():
    v = check_global_batch(64, per_rank_batch=32, world_size=4, accumulation=2)
    assert not v.ok and "Every rank does the same micro-steps" in v.hint


def test_global_batch_divided_by_ranks_gets_per_rank_hint():
    v = check_global_batch(8, per_rank_batch=32, world_size=4)
    assert not v.ok and "ONE rank" in v.hint


def test_global_batch_hint_never_reveals_the_answer():
    v = check_global_batch(7, per_rank_batch=32, world_size=4, accumulation=2)
    assert not v.ok and "Three factors" in v.hint and "256" not in str(v)


@pytest.mark.parametrize("answer", GARBAGE)
def test_global_batch_garbage_gets_a_message_not_an_exception(answer):
    v = check_global_batch(answer, per_rank_batch=32, world_size=4, accumulation=2)
    assert isinstance(v, Verdict) and not v.ok and v.message


# --- check_allreduce_sum ---------------------------------------------------------------------


@pytest.mark.parametrize("world_size, answer", [(1, 1), (2, 3), (4, 10), (8, 36)])
def test_allreduce_sum_right_answer_passes(world_size, answer):
    assert check_allreduce_sum(answer, world_size).ok


@pytest.mark.parametrize("answer, hint_words", [(6, "rank + 1, not its rank"), (4, "largest contribution"),
                                                (1, "in place"), (40, "not added up again"),
                                                (11, "Write down each rank's contribution")])
def test_allreduce_sum_wrong_answers_get_specific_hints(answer, hint_words):
    v = check_allreduce_sum(answer, 4)
    assert not v.ok and hint_words in v.hint and "10" not in v.hint


@pytest.mark.parametrize("answer", GARBAGE)
def test_allreduce_sum_garbage_gets_a_message_not_an_exception(answer):
    v = check_allreduce_sum(answer, 4)
    assert isinstance(v, Verdict) and not v.ok


# --- check_shard -----------------------------------------------------------------------------


@pytest.mark.parametrize("n, world, rank, epoch", [(20, 2, 0, 0), (20, 2, 1, 1), (21, 2, 1, 0), (10, 3, 2, 4)])
def test_shard_right_answer_passes_as_list_or_tensor(n, world, rank, epoch):
    right = real_shard(n, world, rank, epoch)
    assert check_shard(right, n=n, world_size=world, rank=rank, epoch=epoch).ok
    assert check_shard(torch.tensor(right), n=n, world_size=world, rank=rank, epoch=epoch).ok


def test_shard_of_another_rank_gets_rank_hint():
    v = check_shard(real_shard(20, 2, 1, 0), n=20, world_size=2, rank=0, epoch=0)
    assert not v.ok and "another rank" in v.hint


def test_shard_of_epoch_zero_gets_set_epoch_hint():
    v = check_shard(real_shard(20, 2, 0, 0), n=20, world_size=2, rank=0, epoch=1)
    assert not v.ok and "set_epoch is never called" in v.hint and "seed + epoch" in v.hint


def test_unshuffled_shard_gets_shuffle_hint():
    v = check_shard(list(range(1, 20, 2)), n=20, world_size=2, rank=1, epoch=0)
    assert not v.ok and "shuffle=True" in v.hint


def test_contiguous_block_gets_striding_hint():
    v = check_shard(list(range(10)), n=20, world_size=2, rank=0, epoch=0)
    assert not v.ok and "contiguous" in v.hint


def test_shard_missing_padding_gets_padding_hint():
    v = check_shard(real_shard(21, 2, 1, 0)[:-1], n=21, world_size=2, rank=1, epoch=0)
    assert not v.ok and "pads" in v.hint


def test_shard_in_wrong_order_gets_order_hint():
    v = check_shard(sorted(real_shard(20, 2, 0, 0)), n=20, world_size=2, rank=0, epoch=0)
    assert not v.ok and "wrong order" in v.hint


def test_whole_dataset_as_shard_gets_own_part_hint():
    v = check_shard(list(range(20)), n=20, world_size=2, rank=0, epoch=0)
    assert not v.ok and "own part" in v.hint


@pytest.mark.parametrize("answer", GARBAGE + ["0, 1, 2"])
def test_shard_garbage_gets_a_message_not_an_exception(answer):
    v = check_shard(answer, n=20, world_size=2, rank=0, epoch=0)
    assert isinstance(v, Verdict) and not v.ok


def test_shard_with_impossible_setup_gets_a_message_not_an_exception():
    assert not check_shard([1], n=20, world_size=2, rank=5, epoch=0).ok
    assert not check_shard([1], n="twenty", world_size=2, rank=0, epoch=0).ok


# --- check_set_epoch -------------------------------------------------------------------------

GOOD_LOOP = """
for epoch in range(epochs):
    sampler.set_epoch(epoch)
    for x, y in loader:
        train_step(x, y)
"""


def test_set_epoch_before_inner_loop_passes():
    assert check_set_epoch(GOOD_LOOP).ok
    assert check_set_epoch("    " + GOOD_LOOP.strip().replace("\n", "\n    ")).ok  # indented paste


def test_set_epoch_in_a_function_passes():
    def train(model, loader, sampler, epochs):
        for epoch in range(epochs):
            loader.sampler.set_epoch(epoch)
            for step, (x, y) in enumerate(loader):
                model(x)

    assert check_set_epoch(train).ok


def test_set_epoch_with_helper_called_per_epoch_passes():
    assert check_set_epoch("for e in range(3):\n    sampler.set_epoch(e)\n    train_one_epoch(loader)\n").ok


def test_missing_set_epoch_gets_hint():
    v = check_set_epoch("for epoch in range(3):\n    for x in loader:\n        step(x)\n")
    assert not v.ok and "same order" in v.hint


def test_set_epoch_after_inner_loop_gets_placement_hint():
    v = check_set_epoch("for epoch in range(3):\n    for x in loader:\n        step(x)\n"
                        "    sampler.set_epoch(epoch)\n")
    assert not v.ok and "before the inner loop" in v.hint


def test_set_epoch_inside_batch_loop_gets_hint():
    v = check_set_epoch("for epoch in range(3):\n    for x in loader:\n        sampler.set_epoch(epoch)\n")
    assert not v.ok and "per batch" in v.hint
    v = check_set_epoch("for i, x in enumerate(train_loader):\n    sampler.set_epoch(i)\n")
    assert not v.ok and "per batch" in v.hint


def test_set_epoch_outside_loop_gets_hint():
    v = check_set_epoch("sampler.set_epoch(0)\nfor epoch in range(3):\n    for x in loader:\n        step(x)\n")
    assert not v.ok and "inside the epoch loop" in v.hint


def test_set_epoch_with_constant_gets_hint():
    v = check_set_epoch("for epoch in range(3):\n    sampler.set_epoch(0)\n    for x in loader:\n        step(x)\n")
    assert not v.ok and "constant" in v.hint


def test_every_set_epoch_call_is_checked():
    code = GOOD_LOOP + "    val_sampler.set_epoch(epoch)\n"  # second call after the batches
    assert not check_set_epoch(code).ok


@pytest.mark.parametrize("code", ["for epoch in range(3)\n    pass", 42, None, b"bytes", lambda: None])
def test_set_epoch_garbage_gets_a_message_not_an_exception(code):
    v = check_set_epoch(code)
    assert isinstance(v, Verdict) and not v.ok and v.message


# --- check_device (notebook 02, exercise 2) -----------------------------------------------------------------
@pytest.mark.parametrize("answer", ["cuda:1", " CUDA:1 ", 1, torch.device("cuda", 1)])
def test_check_device_accepts_the_local_rank_in_any_spelling(answer):
    assert check_device(answer, rank=5, local_rank=1, gpus_per_node=4).ok


def test_check_device_explains_the_global_rank_mistake_without_giving_the_answer():
    v = check_device("cuda:5", rank=5, local_rank=1, gpus_per_node=4)
    assert not v.ok and "global RANK" in v.hint and "cuda:1" not in v.hint + v.message


@pytest.mark.parametrize("answer, words", [("cuda:7", "4 GPUs"), ("cuda:2", "place on that node"),
                                           ("gpu1", "'cuda:K'"), (None, "'cuda:3'"), ([1], "'cuda:K'")])
def test_check_device_rejects_other_answers_with_a_hint(answer, words):
    v = check_device(answer, rank=5, local_rank=1, gpus_per_node=4)
    assert not v.ok and words in v.hint, v
