"""The course's GPT and its text: exact parameter count, meta-device init, the generated text, the baseline."""
import argparse

import pytest
import torch

from helpers.rank import lm
from helpers.rank.gpt import GPT, GPTConfig, parameter_count
from helpers.rank.text import Windows, generate_text, unigram_loss


@pytest.mark.parametrize("n_layer, d_model, vocab, seq", [(1, 32, 10, 8), (2, 64, 29, 64), (3, 48, 7, 16)])
def test_parameter_count_is_exact(n_layer, d_model, vocab, seq):
    cfg = GPTConfig(vocab_size=vocab, seq_len=seq, n_layer=n_layer, n_head=4, d_model=d_model)
    with torch.device("meta"):
        assert parameter_count(cfg) == sum(p.numel() for p in GPT(cfg).parameters())


def _args(**kw):
    base = dict(seed=3, seq_len=16, n_layer=2, n_head=4, d_model=32, attention="math", checkpoint="none",
                dtype="fp32")
    return argparse.Namespace(**dict(base, **kw))


def test_meta_device_init_equals_a_normal_build_with_the_same_seed():
    args = _args()
    with torch.device("meta"):
        model = GPT(lm.gpt_config(args, 11))
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    model.init_weights(args.seed)
    built = lm.build_gpt(args, 11)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), built.state_dict().values()))
    other = lm.build_gpt(_args(seed=4), 11)  # the check can fail: another seed, other weights
    assert not torch.equal(other.head.weight, built.head.weight)


def test_generated_text_is_deterministic_and_seeded():
    assert generate_text(2000, seed=0) == generate_text(2000, seed=0)
    assert generate_text(2000, seed=0) != generate_text(2000, seed=1)
    assert len(generate_text(2000)) == 2000


def test_unigram_baseline_is_the_entropy_of_the_character_frequencies():
    assert unigram_loss(torch.tensor([0, 0, 0, 0]), 1) == 0
    assert unigram_loss(torch.tensor([0, 1, 0, 1]), 2) == pytest.approx(torch.log(torch.tensor(2.0)).item())


def test_windows_are_inputs_and_next_token_targets():
    w = Windows(torch.arange(21), seq_len=5)
    assert len(w) == 4
    x, y = w[1]
    assert x.tolist() == [5, 6, 7, 8, 9] and y.tolist() == [6, 7, 8, 9, 10]
    with pytest.raises(ValueError, match="cannot hold one window"):
        Windows(torch.arange(5), seq_len=5)


def test_a_sequence_longer_than_the_position_embedding_is_refused():
    model = GPT(GPTConfig(vocab_size=5, seq_len=8, n_layer=1, n_head=2, d_model=8))
    with pytest.raises(ValueError, match="seq_len=8"):
        model(torch.zeros(1, 9, dtype=torch.long))
