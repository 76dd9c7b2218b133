"""helpers.calc.activations: the paper's count, the course GPT's count term by term, checkpointing and TP."""
import pytest

from helpers.calc import activations as act

S, B, H, A = 64, 8, 64, 4
SBH = S * B * H


def test_korthikanti_eq1_is_34_sbh_plus_5_a_s2_b_bytes():
    assert act.korthikanti_layer_bytes(2048, 1, 12288, 96) == 34 * 2048 * 12288 + 5 * 96 * 2048 ** 2


def test_korthikanti_tp_keeps_10_sbh_whole_and_sp_divides_everything():
    t = 8
    no_sp = act.korthikanti_layer_bytes(S, B, H, A, tp=t)
    assert no_sp == pytest.approx(SBH * (10 + (24 + 5 * A * S / H) / t))
    assert act.korthikanti_layer_bytes(S, B, H, A, tp=t, sp=True) == pytest.approx(
        act.korthikanti_layer_bytes(S, B, H, A) / t)


def test_math_layer_is_16_sbh_plus_a_s2_b_elements_plus_named_small_terms():
    terms = act.layer_terms(S, B, H, A, "fp32", "math")
    big = terms["LayerNorm inputs and outputs"] + terms["q, k, v"] + terms["attention output"] \
        + terms["MLP: GELU input and output"]
    assert big == 4 * 16 * SBH
    assert terms["softmax output"] == 4 * A * S * S * B
    assert terms["causal mask"] == S * S and terms["LayerNorm mean and 1/std"] == 4 * 4 * B * S


def test_sdpa_replaces_the_s2_term_by_an_fp32_logsumexp():
    terms = act.layer_terms(S, B, H, A, "bf16", "sdpa")
    assert "softmax output" not in terms and "causal mask" not in terms
    assert terms["logsumexp"] == 4 * A * S * B  # fp32 even in bf16
    assert terms["q, k, v"] == 2 * 3 * SBH


def test_dtype_scales_every_layer_term():
    assert act.layer_bytes(S, B, H, A, "fp64") - S * S == 2 * (act.layer_bytes(S, B, H, A, "fp32") - S * S)


def test_selective_removes_exactly_the_s2_terms_and_full_keeps_the_block_input():
    none, sel = act.layer_terms(S, B, H, A), act.layer_terms(S, B, H, A, checkpoint="selective")
    assert sum(none.values()) - sum(sel.values()) == none["softmax output"] + none["causal mask"]
    assert act.layer_bytes(S, B, H, A, checkpoint="full") == 4 * SBH


def test_tp_without_sp_never_goes_below_the_layernorm_region():
    ln = act.layer_terms(S, B, H, A)["LayerNorm inputs and outputs"] + act.layer_terms(S, B, H, A)[
        "LayerNorm mean and 1/std"]
    for t in (1, 2, 4, 8, 1024):
        assert act.layer_bytes(S, B, H, A, tp=t) >= ln
    assert act.layer_bytes(S, B, H, A, tp=4, sp=True) == pytest.approx(
        (act.layer_bytes(S, B, H, A) - S * S) / 4 + S * S)


def test_whole_model_adds_the_head_once():
    one = act.model_bytes(S, B, H, A, 1, 64)
    two = act.model_bytes(S, B, H, A, 2, 64)
    assert two - one == act.layer_bytes(S, B, H, A)
    assert one / (4 * SBH) == pytest.approx(24.2, abs=0.1)  # the figure measured with MemTracker (notebook 08)


def test_step_memory_adds_activations_to_the_model_states_of_one_tp_share():
    gpt = dict(seq_len=S, batch=B, d_model=H, n_head=A, n_layer=2, vocab=64)
    one = act.step_memory_bytes(1e6, 1, 0, "fp32", gpt=gpt)
    four = act.step_memory_bytes(1e6, 1, 0, "fp32", gpt=gpt, tp=4)
    assert one["total"] == 16e6 + act.model_bytes(S, B, H, A, 2, 64)
    assert four["params"] == 4 * act.tp_local_params(1e6, gpt, 4)
    assert four["activations"]["total"] < one["activations"]["total"]
    assert one["params"] / 4 < four["params"] < one["params"]  # the embeddings and LayerNorms are not split


@pytest.mark.parametrize("bad", [dict(dtype="int8"), dict(attention="flash"), dict(checkpoint="some"), dict(tp=0)])
def test_bad_arguments_are_refused(bad):
    with pytest.raises(ValueError):
        act.layer_terms(S, B, H, A, **bad)


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_tp_local_params_is_what_notebook_09s_plan_leaves_on_a_rank(tp):
    """The calculator's parameters per TP rank equal the sum of the shard shapes notebook 09's plan gives each rank
    (helpers.calc.tp.shard_shape), on the GPT that chapter trains."""
    import math

    import torch

    from helpers.calc import tp as tp_calc
    from helpers.rank.gpt import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=29, seq_len=48, n_layer=2, n_head=12, d_model=96))
    total = sum(p.numel() for p in model.parameters())
    local = sum(math.prod(tp_calc.shard_shape(tuple(p.shape), tp_calc.shard_dim(name), tp))
                for name, p in model.named_parameters())
    assert act.tp_local_params(total, dict(d_model=96, n_layer=2), tp) == local
