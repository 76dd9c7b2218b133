"""course/gpt_at_scale.py: one rank of a real model's layout on fake tensors and a fake process group, called in this
process, against helpers.calc.scale's formulas; the private APIs it rests on, pinned; bad layouts refused before
anything is built."""
from __future__ import annotations

import pytest
import torch.distributed as dist

import course.gpt_at_scale as script
from helpers.calc import activations, scale

# GPT-3 175B in 48 stages of 2 blocks: a real width (12288), heads and sequence (2048), few layers to trace
STAGES = ["--model", "gpt3-175b", "--pp", "48"]


def simulate(*argv):
    return script.simulate(*script.runs(script.parse_args([*map(str, argv)])))


def test_the_private_apis_the_simulation_rests_on_are_where_it_expects():
    """torch.testing._internal's fake process group, FakeTensorMode and FSDPMemTracker's reference kinds are private:
    if torch moves them, this fails first, naming what moved."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType
    from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401 (registers the "fake" backend)

    assert "fake" in dist.Backend.backend_list, "torch no longer registers the 'fake' backend from fake_pg"
    from torch.distributed.device_mesh import DeviceMesh
    assert callable(getattr(DeviceMesh, "_flatten", None)), "DeviceMesh._flatten (EP's dense FSDP group) moved"
    assert set(script.KINDS.values()) <= set(_FSDPRefType), "FSDPMemTracker's reference kinds changed"
    FakeTensorMode(allow_non_fake_inputs=True)


@pytest.mark.parametrize("tp, stage", [(8, 1), (8, 47), (1, 1)])
def test_one_rank_holds_the_formulas_model_states_exactly_and_its_activations_within_5_percent(tp, stage):
    r = simulate(*STAGES, "--world", 48 * tp * 2, "--tp", tp, "--stage", stage)
    m, f = r["measured"], r["formula"]
    assert (r["dp"], f["blocks"]) == (2, 2)
    for key in ("params", "grads", "optimizer"):  # ZeRO-3 over dp: 4 + 4 + 8 bytes per parameter of this rank
        assert f[key] <= m[key] <= f[key] + 4 * 4 * r["shape"]["d_model"], key  # FSDP2 pads rows to a multiple of dp
    assert m["activations after forward"] == pytest.approx(f["activations"], rel=0.05)
    assert not dist.is_initialized()  # the fake group is gone again


def test_the_measurement_tells_torchs_sequence_parallelism_from_megatrons():
    """torch's SequenceParallel plan keeps the all-gathered LayerNorm outputs whole for q/k/v's and up's backward;
    Megatron-LM keeps 1/t and gathers again. The simulation must see the difference (else the 5% claim is empty)."""
    r = simulate(*STAGES, "--world", 768, "--tp", 8, "--stage", 1)
    shape = r["shape"]
    args = (shape["seq_len"], 1, shape["d_model"], shape["n_head"], "bf16", shape["attention"], "none", 8, True)
    megatron = r["formula"]["activations"] - 2 * (activations.layer_bytes(*args, gathered_whole=True)
                                                   - activations.layer_bytes(*args))
    assert r["measured"]["activations after forward"] > 1.3 * megatron


def test_llama3_405b_on_16384_ranks_in_its_authors_layout_holds_the_formula_within_5_percent():
    """The paper's TP 8 x PP 16 x DP 128 on 16,384 ranks (FSDP2 over the 128 here), a middle stage of 8 blocks at
    8192 tokens: one rank's model states and activations by the formulas, within 5%."""
    r = simulate("--model", "llama3-405b", "--world", 16384, "--tp", 8, "--pp", 16, "--stage", 1)
    m, f = r["measured"], r["formula"]
    assert (r["dp"], f["blocks"]) == (128, 8)
    for key in ("params", "grads", "optimizer", "activations"):
        got = m["activations after forward" if key == "activations" else key]
        assert got == pytest.approx(f[key], rel=0.05), key


@pytest.mark.parametrize("stage", [0, 1])
def test_deepseek_v3s_experts_over_ep_64_hold_the_formulas_states_activations_and_all_to_alls(stage):
    """DeepSeek-V3 at its real EP degree (64 of the 128 data-parallel ranks) on 31 stages of 2 blocks: the first
    stage's blocks dense, the second's MoE. Model states exactly (4 of 256 experts a block, sharded over the 2 dp
    ranks that hold them, the rest over 128), activations within 5%, and the bytes the all-to-alls send in the
    step equal notebook 13's formula under balanced routing (nothing is sent: the rows the rank would send)."""
    r = simulate("--model", "deepseek-v3", "--pp", 31, "--world", 31 * 128, "--tp", 1, "--ep", 64, "--stage", stage)
    m, f = r["measured"], r["formula"]
    assert (r["dp"], f["blocks"]) == (128, 2)
    for key in ("params", "grads", "optimizer"):
        assert f[key] <= m[key] <= f[key] + 4 * 4 * r["shape"]["d_model"], key
    assert m["activations after forward"] == pytest.approx(f["activations"], rel=0.05)
    assert m["all-to-all bytes sent"] == f["all-to-all bytes sent"]
    assert (m["all-to-all bytes sent"] > 0) == (stage == 1)  # layers 0-2 are dense


@pytest.mark.parametrize("checkpoint", ["none", "full"])
def test_context_parallel_ranks_hold_the_formulas_bytes_and_the_ring_sends_chapter_12s(checkpoint):
    """CP 4 x TP 2 on 2 blocks of GPT-3's width: FSDP2 shards over dp x cp (the CP ranks hold the same weights), a
    rank keeps its s / cp positions' activations with attention kept as ring attention keeps it (q, k, v, the output
    and its fp32 log-sum-exp), and the ring sends 2 (cp - 1) K/V blocks a layer forward, 4 (cp - 1) backward, the
    forward's twice with recomputation: all equal to the formulas (nothing is sent: fake tensors, a fake group)."""
    r = simulate(*STAGES, "--world", 48 * 2 * 4 * 2, "--tp", 2, "--cp", 4, "--stage", 1, "--checkpoint", checkpoint)
    m, f = r["measured"], r["formula"]
    assert (r["dp"], r["cp"], f["blocks"]) == (2, 4, 2)
    for key in ("params", "grads", "optimizer"):
        assert f[key] <= m[key] <= f[key] + 4 * 4 * r["shape"]["d_model"], key
    assert m["activations after forward"] == f["activations"]
    block = 2048 // 4 * 12288 // 2 * 2  # K or V of a rank's 512 positions, its 48 heads, bf16
    assert m["ring bytes sent"] == f["ring bytes sent"] == 2 * 3 * block * ((2 if checkpoint == "full" else 1) * 2 + 4)
    without = scale.expected(r["shape"], world=768, tp=2, pp=48, stage=1, checkpoint=checkpoint)
    assert f["activations"] < without["activations"] / 3.5  # a quarter of the tokens: a quarter of nearly everything


@pytest.mark.parametrize("argv, problem", [
    (["--model", "llama3-8b", "--world", 64, "--tp", 8, "--cp", 3], "--cp 3 = 24 does not divide --world 64"),
    (["--model", "llama3-8b", "--world", 64, "--tp", 8, "--cp", 8, "--seq-len", 1000],
     "do not split into 128; use a sequence length that is a multiple of 128"),
    (["--model", "deepseek-v3", "--world", 4096, "--tp", 1, "--pp", 16, "--ep", 8, "--cp", 2],
     "context parallelism for dense models only"),
])
def test_a_context_parallel_layout_that_cannot_be_built_is_refused_before_anything_is(argv, problem):
    with pytest.raises(SystemExit, match=problem):
        simulate(*argv)
    assert not dist.is_initialized()


@pytest.mark.parametrize("argv, problem", [
    (["--model", "deepseek-v3", "--world", 2048, "--tp", 1, "--pp", 16, "--ep", 3], "--ep 3 does not divide the 128"),
    (["--model", "deepseek-v3", "--world", 3 * 16 * 256, "--tp", 1, "--pp", 16, "--ep", 3],
     "--ep 3 does not split the 256 experts; use one of 1, 2, 4,"),
    (["--model", "deepseek-v3", "--world", 2048, "--tp", 2, "--pp", 16, "--ep", 8], "spreads a mixture of experts"),
    (["--model", "llama3-8b", "--world", 64, "--tp", 8, "--ep", 2], "this model has no experts to spread"),
])
def test_an_expert_layout_that_cannot_be_built_is_refused_before_anything_is(argv, problem):
    with pytest.raises(SystemExit, match=problem):
        simulate(*argv)
    assert not dist.is_initialized()


@pytest.mark.parametrize("argv, problem", [
    (["--world", 100, "--tp", 8], "does not divide --world 100"),
    (["--world", 48, "--tp", 3], "does not divide the 32 heads; use one of 1, 2, 4, 8, 16, 32"),
    (["--world", 64, "--tp", 8, "--pp", 2, "--stage", 2], "--stage 2 is not one of the 2 stages"),
    (["--world", 64, "--tp", 0], "--tp 0: a degree is a whole number of ranks"),
    (["--world", 40, "--tp", 1, "--pp", 5], "--pp 5 does not split the 32 layers into equal stages"),
])
def test_a_layout_that_cannot_be_built_is_refused_before_anything_is(argv, problem):
    with pytest.raises(SystemExit, match=problem):
        simulate("--model", "llama3-8b", *argv)
    assert not dist.is_initialized()


def test_the_course_gpt_at_gpt3s_shape_is_gpt3s_parameter_count():
    """GPT-3's block is the course GPT's (MHA, 4h GELU MLP): 175B within 0.5%; Llama 3's is not (GQA, SwiGLU)."""
    assert scale.course_params(scale.MODELS["gpt3-175b"]) == pytest.approx(175e9, rel=0.005)


def test_llama3_405bs_126_layers_split_as_its_authors_did_one_fewer_on_the_first_and_last_stage():
    shape = scale.MODELS["llama3-405b"]
    blocks = [scale.stage_blocks(shape, 16, s) for s in range(16)]
    assert blocks == [7] + [8] * 14 + [7] and sum(blocks) == 126
    assert scale.stage_blocks(scale.MODELS["llama3-8b"], 5, 0) is None  # 32 layers: neither 5 nor 5 x 7 - 2
