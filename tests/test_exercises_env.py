"""helpers.notebook.exercises.env (notebook 00): right answers pass, each kind of wrong answer gets its own hint."""
import doctest

import pytest
import torch

from helpers.notebook.exercises import env as ex

SIZE, SECONDS, N = 256 * 2**20, 0.025, 6  # the exercise in notebook 00
ALGBW = SIZE / SECONDS / 1e9
BUSBW = ALGBW * 2 * (N - 1) / N
GARBAGE = ["17.9", None, [17.9], {"a": 1}, object(), float("nan"), float("inf"), True]


def busbw(answer):
    return ex.check_busbw(answer, size_bytes=SIZE, seconds=SECONDS, world_size=N)


def test_docstring_examples_hold():
    failed, attempted = doctest.testmod(ex, optionflags=doctest.ELLIPSIS)
    assert attempted >= 3 and failed == 0


@pytest.mark.parametrize("answer", [BUSBW, round(BUSBW, 1), round(BUSBW, 2), torch.tensor(BUSBW)])
def test_busbw_right_answer_passes(answer):
    assert busbw(answer).ok


@pytest.mark.parametrize("answer, words", [
    (ALGBW, "That is algbw"),
    (BUSBW * 1e9 / 2**30, "1e9 bytes per second"),
    (ALGBW * 1e9 / 2**30, "1e9 bytes per second"),
    (BUSBW * 1e3, "power of 1000"),
    (BUSBW / 1e3, "power of 1000"),
    (ALGBW * 2, "The factor is not 2"),
    (ALGBW * (N - 1) / N, "reduce-scatter AND an all-gather"),
    (ALGBW * N / (2 * (N - 1)), "Upside down"),
    (ALGBW * 2 * (N - 1), "divide by n"),
    (1.0, "Two steps"),
])
def test_busbw_each_wrong_answer_gets_its_own_hint(answer, words):
    v = busbw(answer)
    assert not v.ok and words in v.hint
    assert f"{BUSBW:.2f}" not in str(v) and f"{BUSBW:.1f}" not in str(v)  # the hint never gives the answer away


@pytest.mark.parametrize("answer", GARBAGE)
def test_busbw_garbage_gets_a_verdict_not_an_exception(answer):
    v = busbw(answer)
    assert not v.ok and v.message and v.hint


def launch(answer, gpus=8, visible="0,1,2,3", cores=64):
    return ex.check_launch(answer, gpus_installed=gpus, visible_devices=visible, cores=cores)


@pytest.mark.parametrize("answer", [("nccl", 4), ["NCCL", 4], (" nccl ", torch.tensor(4).item())])
def test_launch_right_answer_passes(answer):
    assert launch(answer).ok


def test_launch_without_visibility_limit_counts_every_gpu():
    assert launch(("nccl", 8), visible=None).ok and not launch(("nccl", 4), visible=None).ok


@pytest.mark.parametrize("answer, words", [
    (("nccl", 8), "CUDA_VISIBLE_DEVICES decides"),
    (("gloo", 4), "GPU to GPU"),
    (("nccl", 64), "one per core"),
    (("nccl", 6), "more ranks than visible GPUs"),
    (("nccl", 1), "one rank per GPU"),
    (("mpi", 4), "builds made with MPI"),
    (("horovod", 4), "not a torch.distributed backend"),
])
def test_launch_each_wrong_answer_gets_its_own_hint(answer, words):
    v = launch(answer)
    assert not v.ok and words in v.hint + v.message


def test_launch_without_visible_gpus_wants_gloo_within_the_cores():
    assert launch(("gloo", 2), visible="", cores=4).ok
    v = launch(("nccl", 2), visible="", cores=4)
    assert not v.ok and "hides them all" in v.hint
    assert "Which backend runs on CPUs" in launch(("nccl", 2), gpus=0, visible=None, cores=4).hint
    assert "overcommit" in launch(("gloo", 8), visible="", cores=4).message
    assert not launch(("gloo", 0), visible="", cores=4).ok


@pytest.mark.parametrize("answer", [None, "nccl", ("nccl",), ("nccl", 4, 1), (4, "nccl"), ("nccl", 4.0),
                                    ("nccl", True), {"backend": "nccl"}])
def test_launch_garbage_gets_a_verdict_not_an_exception(answer):
    v = launch(answer)
    assert not v.ok and v.message and v.hint
