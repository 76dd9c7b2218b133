"""helpers.calc.plan, the configuration guide of notebook 10: per-rank memory of a DP x TP x PP layout from the
course's formulas, the layouts a machine allows, the proposal's order, and the per-axis communication."""
from __future__ import annotations

import pytest

from helpers.calc import activations, cp, memory, plan, scale, stages
from helpers.rank.gpt import GPTConfig, parameter_count

TINY = dict(vocab=29, seq_len=32, n_layer=4, n_head=4, d_model=32, attention="math")
GPT3_XL = dict(vocab=50257, seq_len=2048, n_layer=24, n_head=16, d_model=2048, attention="sdpa")


@pytest.mark.parametrize("shape", [TINY, dict(TINY, n_layer=12, d_model=64), GPT3_XL])
def test_stage_params_add_up_to_the_gpts_own_count_on_every_pipeline(shape):
    cfg = GPTConfig(vocab_size=shape["vocab"], seq_len=shape["seq_len"], n_layer=shape["n_layer"],
                    n_head=shape["n_head"], d_model=shape["d_model"])
    for pp in (1, 2, 4):
        assert sum(plan.stage_params(shape, pp, s) for s in range(pp)) == parameter_count(cfg)
    for tp in (2, 4):  # pp 1: notebook 09's plan, as the step calculator counts it
        assert plan.stage_params(shape, 1, 0, tp) == activations.tp_local_params(parameter_count(cfg), shape, tp)


def test_micro_batches_in_flight_follow_the_schedule():
    assert [plan.in_flight("gpipe", 4, s, 8) for s in range(4)] == [8, 8, 8, 8]
    assert [plan.in_flight("1f1b", 4, s, 8) for s in range(4)] == [4, 3, 2, 1]
    assert [plan.in_flight("1f1b", 4, s, 2) for s in range(4)] == [2, 2, 2, 1]
    assert plan.in_flight("gpipe", 1, 0, 8) == 1  # no pipeline: accumulation, one micro-batch at a time
    with pytest.raises(ValueError, match="schedule must be one of"):
        plan.in_flight("zbv", 2, 0, 4)


def test_stage_activations_add_up_to_the_whole_models_formula():
    s, b, h, a, L, v = 32, 4, 32, 4, 4, 29
    whole = activations.model_bytes(s, b, h, a, L, v)
    for pp in (1, 2, 4):
        assert sum(plan.microbatch_activation_bytes(TINY, b, pp, st) for st in range(pp)) == pytest.approx(whole)


def test_rank_memory_is_zeros_formula_plus_the_activations_in_flight():
    one = plan.rank_memory(TINY, dp=2, tp=2, pp=2, micro_batch=4, microbatches=4, schedule="gpipe")
    f1b = plan.rank_memory(TINY, dp=2, tp=2, pp=2, micro_batch=4, microbatches=4, schedule="1f1b")
    for st in range(2):
        states = memory.zero_model_state_bytes(plan.stage_params(TINY, 2, st, 2), 2, 0, "fp32")
        assert (one[st]["params_bytes"], one[st]["grads"], one[st]["optimizer"]) == (
            states["params"], states["grads"], states["optimizer"])
        per_mb = plan.microbatch_activation_bytes(TINY, 4, 2, st, 2)
        assert one[st]["activations"] == 4 * per_mb and f1b[st]["activations"] == (2 - st) * per_mb
    z3 = plan.rank_memory(TINY, dp=4, zero=3)[0]
    assert z3["params_bytes"] == 4 * plan.stage_params(TINY) / 4
    counted = plan.rank_memory(TINY, step_counters=True)[0]["optimizer"] - plan.rank_memory(TINY)[0]["optimizer"]
    assert counted == plan.ADAM_STEP_BYTES * (10 * 4 + 2 + 3)
    with pytest.raises(ValueError, match="precision"):
        plan.rank_memory(TINY, precision="fp8")


def test_layouts_respect_the_node_the_heads_the_layers_and_the_batch():
    got = list(plan.layouts(TINY, n_gpus=8, gpus_per_node=4, global_batch=16))
    assert got and all(dp * tp * pp == 8 for dp, tp, pp, _ in got)
    assert all(tp <= 4 and 4 % tp == 0 and TINY["n_layer"] % pp == 0 for _, tp, pp, _ in got)
    assert all(16 % dp == 0 and m == 16 // dp and (pp == 1 or m >= pp) for dp, _, pp, m in got)
    assert (2, 2, 2, 8) in got and not any(tp == 8 for _, tp, _, _ in got)


def test_the_proposal_fits_is_fastest_first_and_refuses_what_cannot_fit():
    fits = plan.propose(GPT3_XL, gpu_bytes=80 * 2**30, n_gpus=8, gpus_per_node=8, global_batch=512)
    assert fits and all(f["bytes"] <= plan.USABLE * 80 * 2**30 for f in fits)
    times = [f["seconds"]["total"] for f in fits]
    assert times == sorted(times)
    assert all(f["layout"]["zero"] <= 1 for f in fits if f["layout"]["pp"] > 1)  # DeepSpeed's pipeline rule
    # shrink the GPU below the proposal's need: that layout must drop out, and something else come first
    smaller = fits[0]["bytes"] / plan.USABLE * 0.99
    again = plan.propose(GPT3_XL, gpu_bytes=smaller, n_gpus=8, gpus_per_node=8, global_batch=512)
    assert again and fits[0]["layout"] not in [f["layout"] for f in again]
    assert plan.propose(GPT3_XL, gpu_bytes=2**30, n_gpus=8, gpus_per_node=8, global_batch=512) == []
    with pytest.raises(ValueError, match="multiple of gpus_per_node"):
        plan.propose(GPT3_XL, gpu_bytes=80 * 2**30, n_gpus=12, gpus_per_node=8, global_batch=512)


def test_communication_per_axis_vanishes_without_the_axis_and_grows_with_it():
    none = plan.step_comm_bytes(TINY)
    assert none == {"tp": 0.0, "pp": 0.0, "dp": 0.0}
    two = plan.step_comm_bytes(TINY, dp=2, tp=2, pp=2, micro_batch=4, microbatches=2)
    act = 4 * 32 * 4 * 32  # fp32 s b h
    assert two["tp"] == 2 * 2 * 4 * act * 2 * 1 / 2  # m x blocks x 4 all-reduces x 2 (t - 1) / t
    assert two["pp"] == 2 * 2 * act
    assert two["dp"] == 4 * plan.stage_params(TINY, 2, 0, 2) * 2 * 1 / 2
    assert plan.step_comm_bytes(TINY, dp=2, zero=3)["dp"] == 1.5 * plan.step_comm_bytes(TINY, dp=2)["dp"]
    # accumulation: ZeRO-0/1 reduce once per step, ZeRO-2 and -3 once per micro-batch
    for zero, per_mb in ((0, False), (1, False), (2, True), (3, True)):
        one, four = (plan.step_comm_bytes(TINY, dp=2, zero=zero, microbatches=m)["dp"] for m in (1, 4))
        assert four == (4 * one if per_mb else one)


def test_the_step_model_charges_recomputation_the_bubble_and_tp():
    base = dict(dp=8, tp=1, pp=1, zero=0, checkpoint="none", sp=False, microbatches=64)
    t = plan.step_seconds(GPT3_XL, base, global_batch=512, micro_batch=1, gpus_per_node=8)
    full = plan.step_seconds(GPT3_XL, dict(base, checkpoint="full"), global_batch=512, micro_batch=1, gpus_per_node=8)
    assert full["compute"] == pytest.approx(4 / 3 * t["compute"]) and t["tp"] == 0
    piped = plan.step_seconds(GPT3_XL, dict(base, dp=2, pp=4, microbatches=256), global_batch=512, micro_batch=1,
                              gpus_per_node=8)
    assert piped["bubble"] == pytest.approx(3 / 259) and piped["compute"] > t["compute"]


def test_megatron_splits_the_embedding_and_head_over_the_vocabulary():
    h, v, s = GPT3_XL["d_model"], GPT3_XL["vocab"], GPT3_XL["seq_len"]
    for tp in (2, 8):
        whole, split = (plan.stage_params(GPT3_XL, 1, 0, tp, vocab_parallel=vp) for vp in (False, True))
        assert whole - split == 2 * (v - -(-v // tp)) * h  # word embedding and head: ceil(V / tp) rows each
        first, last = (plan.stage_params(GPT3_XL, 2, st, tp, vocab_parallel=True) for st in (0, 1))
        assert first - last == (s - 2) * h  # the position embedding stays whole; the final LayerNorm is 2 h
    assert plan.stage_params(GPT3_XL, 1, 0, 1, vocab_parallel=True) == plan.stage_params(GPT3_XL)


def test_dp_traffic_hides_only_behind_the_compute_that_runs_beside_it():
    """ZeRO-0/1 reduce once, after the last micro-batch's backward: only that backward covers it; ZeRO-2 behind
    every micro-batch's backward; ZeRO-3 behind the whole compute."""
    base = dict(dp=64, tp=1, pp=1, zero=1, checkpoint="none", sp=False)
    shape = dict(GPT3_XL, n_layer=40, n_head=40, d_model=5120)

    def t(**k):
        return plan.step_seconds(shape, dict(base, **k), global_batch=1024, micro_batch=1, gpus_per_node=8)

    one, many = t(microbatches=1), t(microbatches=16)  # 64 sequences a step would need m = 1 at dp 64
    backward = many["compute"] * 2 / 3
    assert many["dp"] == one["dp"] and many["dp_exposed"] == pytest.approx(max(0, many["dp"] - backward / 16))
    assert many["dp_exposed"] > 0
    z2, z3 = t(microbatches=16, zero=2), t(microbatches=16, zero=3)
    assert z2["dp_exposed"] == pytest.approx(max(0, z2["dp"] - backward))
    assert z3["dp_exposed"] == pytest.approx(max(0, z3["dp"] - z3["compute"]))
    full = t(microbatches=16, checkpoint="full")
    assert full["dp_exposed"] == pytest.approx(max(0, full["dp"] - full["compute"] * 3 / 4 / 16))


def test_llama3_405b_splits_its_126_layers_as_its_authors_did_and_the_planner_places_it():
    """126 layers on 16 stages: one fewer on the first and last (Llama 3, Sec. 3.3.2); a count that is neither equal
    nor that is refused. The per-stage counts still add up to the whole model, and the planner now enumerates the
    paper's TP 8 x PP 16 x DP 128 on 16,384 GPUs, where it could only take pp dividing the layers before."""
    assert plan.stage_sizes(126, 16) == [7] + [8] * 14 + [7]
    assert plan.stage_sizes(7, 3) == [2, 3, 2] and plan.stage_sizes(32, 5) is None
    shape = dict(vocab=128256, seq_len=8192, n_layer=126, n_head=128, d_model=16384, attention="sdpa")
    assert sum(plan.stage_params(shape, 16, s) for s in range(16)) == plan.stage_params(shape)
    middle, first = plan.stage_params(shape, 16, 1, 8), plan.stage_params(shape, 16, 0, 8)
    assert middle == plan.stage_params(shape, 16, 14, 8) and middle % 8 == 0  # 8 blocks on every middle stage
    assert first == 7 * middle // 8 + (128256 + 8192) * 16384  # 7 blocks, and the embeddings (whole over TP here)
    with pytest.raises(ValueError, match="126 layers do not split into 5 stages"):
        plan.stage_params(shape, 5, 0)
    assert (128, 8, 16, 16) in set(plan.layouts(shape, 16384, 8, global_batch=2048))
    fits = plan.propose(shape, gpu_bytes=80e9, n_gpus=16384, gpus_per_node=8, global_batch=2048)
    paper = [f for f in fits if (f["layout"]["dp"], f["layout"]["tp"], f["layout"]["pp"]) == (128, 8, 16)]
    assert paper, "the paper's layout fits in 80 GB by the formulas"


def test_context_parallelism_splits_the_sequence_and_shares_the_weights_like_dp():
    """cp ranks hold a 1/cp share of each sequence (notebook 12's ring attention keeps what a flash kernel keeps),
    the same weights as DP ranks (ZeRO shards over dp x cp), and send ring attention's K/V blocks; cp 1 is the
    planner as it was."""
    shape = dict(GPT3_XL, attention="math")
    assert plan.microbatch_activation_bytes(shape, 2, cp=1) == plan.microbatch_activation_bytes(shape, 2)
    quarter = dict(shape, seq_len=shape["seq_len"] // 4, attention="sdpa")
    assert plan.microbatch_activation_bytes(shape, 2, 2, 1, 2, True, "bf16", cp=4) == \
        plan.microbatch_activation_bytes(quarter, 2, 2, 1, 2, True, "bf16")
    cp2 = plan.rank_memory(GPT3_XL, dp=2, cp=2, zero=3)[0]
    dp4 = plan.rank_memory(GPT3_XL, dp=4, zero=3)[0]
    states = ("params_bytes", "grads", "optimizer")
    assert [cp2[k] for k in states] == [dp4[k] for k in states]
    assert "cp" not in plan.step_comm_bytes(GPT3_XL, dp=2, tp=2)
    mha = plan.step_comm_bytes(GPT3_XL, dp=2, tp=2, cp=4, microbatches=3, precision="mixed")
    gqa = plan.step_comm_bytes(dict(GPT3_XL, n_kv_head=4), dp=2, tp=2, cp=4, microbatches=3, precision="mixed")
    ring = cp.ring_bytes_per_layer(1, 2048, 2048 // 2, 4, 2)  # a TP rank's half of the heads, bf16
    assert mha["cp"] == 3 * 24 * (ring["forward"] + ring["backward"]) == 4 * gqa["cp"]
    assert mha["dp"] == plan.step_comm_bytes(GPT3_XL, dp=8, tp=2, microbatches=3, precision="mixed")["dp"]
    got = list(plan.mesh_layouts(GPT3_XL, 64, 8, 32, cps=(1, 4, 3)))
    assert got and all(dp * c * tp * pp == 64 and 32 % dp == 0 for dp, c, tp, pp, _ in got)
    assert {c for _, c, _, _, _ in got} == {1, 4}  # 3 ranks: 6 zig-zag chunks do not split 2048 positions
    assert [l for l in got if l[1] == 1] == [(dp, 1, tp, pp, m) for dp, tp, pp, m in plan.layouts(GPT3_XL, 64, 8, 32)]


def test_llama3_405b_at_131k_tokens_needs_context_parallelism_and_its_layout_fits():
    """Llama 3 405B's long-context stage: 16,384 GPUs, TP 8, CP 16, PP 16 (so DP 8), 16M tokens a step = 128
    sequences of 131,072 (Llama 3's hyperparameters as Balaji's SC'24 slide gives them; the paper's Table 4 not
    checked here). By the formulas no layout without context parallelism fits in 80 GB, and the authors' fits."""
    shape = dict(vocab=128256, seq_len=131072, n_layer=126, n_head=128, n_kv_head=8, d_model=16384, attention="sdpa")
    fits = plan.propose(shape, gpu_bytes=80e9, n_gpus=16384, gpus_per_node=8, global_batch=128,
                        cps=(1, 2, 4, 8, 16, 32))
    assert fits and min(f["layout"]["cp"] for f in fits) == 16
    assert any((f["layout"]["dp"], f["layout"]["cp"], f["layout"]["tp"], f["layout"]["pp"]) == (8, 16, 8, 16)
               for f in fits)


def test_the_examples_in_the_docstrings_hold():
    import doctest

    for module, examples in ((plan, 1), (stages, 3)):
        failed, attempted = doctest.testmod(module)
        assert attempted >= examples and failed == 0, module.__name__


def test_mfu_is_the_efficiency_less_what_the_bubble_recomputation_and_exposed_traffic_take():
    """With nothing exposed and no pipeline, the model's MFU is its assumed efficiency; full recomputation does a
    third more work for the same model FLOPs (x 3/4), and the bubble idles (1 - bubble) of the step."""
    eff = plan.H100_NODE["efficiency"]

    def at(lay):
        lay = dict(dict(zero=0, checkpoint="none", microbatches=1, tp=1, pp=1), **lay)
        t = plan.step_seconds(GPT3_XL, lay, global_batch=512, micro_batch=1, gpus_per_node=8)
        return plan.mfu(GPT3_XL, lay, t["compute"], global_batch=512), t

    assert at(dict(dp=8))[0] == pytest.approx(eff)
    assert at(dict(dp=8, checkpoint="full"))[0] == pytest.approx(eff * 3 / 4)
    piped, t = at(dict(dp=2, pp=4, microbatches=16))
    assert piped == pytest.approx(eff * (1 - t["bubble"])) and t["bubble"] > 0
    t = plan.step_seconds(GPT3_XL, dict(dp=64, tp=1, pp=1, zero=0, checkpoint="none", microbatches=8),
                          global_batch=512, micro_batch=1, gpus_per_node=8)
    lay = dict(dp=64, tp=1, pp=1)
    assert t["dp_exposed"] > 0 and plan.mfu(GPT3_XL, lay, t["total"], global_batch=512) < eff


def test_the_interleaved_schedule_shrinks_the_bubble_and_holds_more_on_the_first_rank():
    """Megatron-LM's interleaving (Narayanan et al. 2021, Sec. 2.2.2): v chunks per rank divide the fill and drain by
    v, (p - 1) / (v m + p - 1); rank 0 holds p + (p - 1) / v micro-batches' activations against 1F1B's p, and its
    sends happen v times per micro-batch."""
    assert plan.bubble(4, 8) == pytest.approx(3 / 11) and plan.bubble(4, 8, 2) == pytest.approx(3 / 19)
    assert [plan.in_flight("interleaved", 4, s, 8, 2) for s in range(4)] == [5.5, 4.5, 3.5, 2.5]
    for p, v in ((4, 2), (8, 4), (16, 2)):
        assert plan.in_flight("interleaved", p, 0, 64, v) == pytest.approx(p + (p - 1) / v)
    assert plan.in_flight("interleaved", 4, 0, 1, 2) == 1  # never more than the micro-batches there are
    for schedule, v in (("1f1b", 2), ("interleaved", 1)):
        with pytest.raises(ValueError, match="virtual stages per rank"):
            plan.in_flight(schedule, 4, 0, 8, v)
    shape = dict(TINY, n_layer=8)
    chunks = [plan.stage_params(shape, 2, s, virtual=2) for s in range(2)]
    assert sum(chunks) == plan.stage_params(shape)  # rank 0: chunks 0 and 2; rank 1: 1 and 3, with the head
    assert chunks == [plan.stage_params(shape, 2, s) for s in range(2)]  # 2 blocks a chunk: the same blocks a rank
    f1b = plan.rank_memory(shape, pp=2, microbatches=8)
    inter = plan.rank_memory(shape, pp=2, microbatches=8, schedule="interleaved", virtual=2)
    assert inter[0]["activations"] == pytest.approx(f1b[0]["activations"] * 2.5 / 2)
    comm = {v: plan.step_comm_bytes(shape, pp=2, microbatches=8, virtual=v)["pp"] for v in (1, 2)}
    assert comm[2] == 2 * comm[1] > 0


def test_llama3_405b_interleaved_keeps_its_uneven_stages_and_beats_1f1b_in_the_model():
    """126 layers in 32 chunks of 4, the first and last of 3: rank 0 holds 3 + 4 = 7 blocks, a middle rank 8, as
    without interleaving. With 16 micro-batches on 16 stages the modelled bubble falls from 48% to 32%."""
    shape = dict(vocab=128256, seq_len=8192, n_layer=126, n_head=128, d_model=16384, attention="sdpa")
    assert [plan.stage_params(shape, 16, s, 8, virtual=2) for s in (0, 1, 15)] == [
        plan.stage_params(shape, 16, s, 8) for s in (0, 1, 15)]
    lay = dict(dp=128, tp=8, pp=16, zero=1, checkpoint="full", sp=True, microbatches=16, vocab_parallel=True)
    one = plan.step_seconds(shape, lay, global_batch=2048, micro_batch=1, gpus_per_node=8)
    two = plan.step_seconds(shape, dict(lay, schedule="interleaved", virtual=2), global_batch=2048, micro_batch=1,
                            gpus_per_node=8)
    assert (round(one["bubble"], 2), round(two["bubble"], 2)) == (0.48, 0.32) and two["total"] < one["total"]
    fits = plan.propose(shape, gpu_bytes=80e9, n_gpus=16384, gpus_per_node=8, global_batch=2048,
                        schedules=("1f1b", "interleaved"))
    paper = {f["layout"]["schedule"] for f in fits if (f["layout"]["dp"], f["layout"]["tp"], f["layout"]["pp"]) ==
             (128, 8, 16)}
    assert paper == {"1f1b", "interleaved"}
    assert all(f["layout"]["microbatches"] % f["layout"]["pp"] == 0 for f in fits
               if f["layout"]["schedule"] == "interleaved")
    with pytest.raises(ValueError, match="schedule must be one of"):
        plan.propose(shape, gpu_bytes=80e9, n_gpus=16384, gpus_per_node=8, global_batch=2048, schedules=("zbv",))


DEEPSEEK_V3 = scale.DEEPSEEK_V3  # the course GPT at DeepSeek-V3's shape (its comment says how)


def _course_moe(shape: dict, experts: int, top_k: int) -> dict:
    """Notebook 13's model: every block's MLP (the course GPT's, f = 4 h) replaced by ``experts`` of them."""
    return dict(shape, moe=dict(experts=experts, top_k=top_k, ffn=4 * shape["d_model"], dense_ffn=4 * shape["d_model"]))


@pytest.mark.parametrize("experts, top_k, ep", [(4, 1, 1), (4, 2, 2), (8, 2, 4)])
def test_a_mixture_of_experts_counts_as_notebook_13_and_its_model_count(experts, top_k, ep):
    """The course MoE GPT's parameters by the planner equal chapter 13's count (helpers.calc.moe.parameters) and
    what helpers.rank.moe builds: all experts in total, top-k of them active, E / ep on an EP rank."""
    from helpers.calc import moe
    from helpers.rank.gpt import GPT
    from helpers.rank.moe import moeify

    shape = _course_moe(TINY, experts, top_k)
    L, h = TINY["n_layer"], TINY["d_model"]
    counts = moe.parameters(plan.stage_params(TINY) - L * 8 * h * h, L, h, experts, top_k, ep)
    assert (plan.stage_params(shape), plan.active_params(shape), plan.stage_params(shape, ep=ep)) == (
        counts["total"], counts["active"], counts["per_rank"])
    cfg = GPTConfig(vocab_size=TINY["vocab"], seq_len=TINY["seq_len"], n_layer=L, n_head=TINY["n_head"], d_model=h)
    built = moeify(GPT(cfg), experts, top_k, 1.25, seed=0)
    assert sum(p.numel() for p in built.parameters()) == plan.stage_params(shape)
    split = plan.stage_param_split(shape, ep=ep)
    assert split["experts"] == L * experts // ep * 8 * h * h
    assert sum(plan.stage_params(shape, 2, s, ep=ep) for s in range(2)) == plan.stage_params(shape, ep=ep)


def test_deepseek_v3_shaped_holds_its_published_totals():
    """671 B parameters, 37 B of them a token uses (Sec. 1): the course GPT at DeepSeek-V3's shape holds these within
    2%, once its 61 main layers are counted with MLA's attention (q down 7168 x 1536, q up 1536 x 128 x 192, kv down
    7168 x 576, kv up 512 x 128 x 256, out 128 x 128 x 7168: its config's ranks and head sizes) in place of MHA's
    4 h^2 and without the learned position embedding DeepSeek-V3 does not have (RoPE)."""
    h = DEEPSEEK_V3["d_model"]
    mla = 7168 * 1536 + 1536 * 128 * 192 + 7168 * (512 + 64) + 512 * 128 * (128 + 128) + 128 * 128 * 7168
    main = dict(DEEPSEEK_V3, n_layer=61)
    as_published = {f: f(main) - 61 * (4 * h * h - mla) - DEEPSEEK_V3["seq_len"] * h
                    for f in (plan.stage_params, plan.active_params)}
    assert as_published[plan.stage_params] == pytest.approx(671e9, rel=0.02)
    assert as_published[plan.active_params] == pytest.approx(37e9, rel=0.02)
    with pytest.raises(ValueError, match="256 experts do not split over ep 3"):
        plan.stage_params(DEEPSEEK_V3, ep=3)


def test_expert_parallelism_shards_the_experts_their_states_and_adds_the_all_to_alls():
    """EP ranks are taken from the dp ranks: each holds E / ep experts, whose ZeRO group is dp / ep; per MoE block
    and micro-batch a rank sends notebook 13's four all-to-alls, 4 T k h e (ep - 1) / ep; ep 1 sends none."""
    from helpers.calc import moe

    shape = _course_moe(TINY, 8, 2)
    L, h, s = TINY["n_layer"], TINY["d_model"], TINY["seq_len"]
    split = plan.stage_param_split(shape, ep=4)
    got = plan.rank_memory(shape, dp=8, ep=4, zero=1, precision="mixed")[0]
    assert got["optimizer"] == 12 * split["dense"] / 8 + 12 * split["experts"] / 2
    assert got["grads"] == 2 * (split["dense"] + split["experts"]) and got["experts"] == split["experts"]
    with pytest.raises(ValueError, match="ep 4 does not divide the dp x cp = 2 ranks"):
        plan.rank_memory(shape, dp=2, ep=4)
    comm = plan.step_comm_bytes(shape, dp=8, ep=4, micro_batch=2, microbatches=3, precision="mixed")
    one = moe.uniform_bytes_per_layer(2 * s, 2, h, 4, 2)
    assert comm["ep"] == 3 * L * sum(x[d] for x in one.values() for d in x) == 3 * L * 4 * 2 * s * 2 * h * 2 * 3 / 4
    assert plan.step_comm_bytes(shape, dp=8, ep=1)["ep"] == 0
    assert comm["dp"] == 2 * (split["dense"] * 7 / 8 + split["experts"] * 1 / 2) * 2
    t = plan.step_seconds(shape, dict(dp=8, tp=1, pp=1, zero=1, checkpoint="none", microbatches=3, ep=4),
                          global_batch=48, micro_batch=2, gpus_per_node=8)
    assert t["ep"] == pytest.approx(comm["ep"] / plan.H100_NODE["nvlink"]) and t["total"] > t["compute"]
    dense = plan.step_seconds(TINY, dict(dp=8, tp=1, pp=1, zero=1, checkpoint="none", microbatches=3),
                              global_batch=48, micro_batch=2, gpus_per_node=8)
    sparse_flops = plan.model_flops(shape, 1, 48)["total"] - plan.model_flops(TINY, 1, 48)["total"]
    assert sparse_flops == 6 * 48 * s * L * (h * 8 + 2 * 8 * h * h - 8 * h * h)  # a router and one more expert
    assert dense["ep"] == 0


def test_moe_activations_keep_each_tokens_experts_and_its_rows_going_and_coming():
    """A MoE block keeps, per token, its top-k and shared experts' hidden activations, its k rows as dispatched and
    as combined, and the router's fp32 probabilities, top-k indices and gate weights; a course MoE with one expert and
    top-1 keeps the dense MLP's 8 s b h and those extras."""
    shape = _course_moe(TINY, 1, 1)
    s, b, h, L = TINY["seq_len"], 2, TINY["d_model"], TINY["n_layer"]
    extra = plan.microbatch_activation_bytes(shape, b) - plan.microbatch_activation_bytes(TINY, b)
    assert extra == L * (4 * s * b * 2 * h + s * b * (4 * 1 + 8 + 4))
    assert plan.microbatch_activation_bytes(shape, b, checkpoint="full") == plan.microbatch_activation_bytes(
        TINY, b, checkpoint="full")  # the block's input alone
    ds = plan.mlp_activation_bytes(DEEPSEEK_V3, 10, 4096, "bf16")
    assert ds == 2 * 4096 * (9 * 4 * 2048 + 2 * 8 * 7168) + 4096 * (4 * 256 + 8 * (8 + 2))
    assert plan.mlp_activation_bytes(DEEPSEEK_V3, 0, 4096, "bf16") == 2 * 4096 * 4 * 18432


_PLANNED: dict = {}


def _planned(entry: dict) -> dict:
    """scale.planned(entry), once per entry for this module (DeepSeek-V3's search takes seconds)."""
    if entry["name"] not in _PLANNED:
        _PLANNED[entry["name"]] = scale.planned(entry)
    return _PLANNED[entry["name"]]


@pytest.mark.parametrize("entry", scale.PUBLISHED, ids=[e["name"] for e in scale.PUBLISHED])
def test_every_published_layout_fits_by_the_formulas_and_the_planner_places_it(entry):
    """Stated, not tuned: each layout its authors ran fits in 80 GB by the formulas on their machine and batch; the
    planner gives it a place among the layouts that fit and a modelled MFU no higher than the assumed efficiency
    (the chapter prints these beside the reported MFU and says what the authors weighed that the model does not)."""
    got = _planned(entry)
    assert got["theirs"] is not None, f"{entry['name']}: the authors' layout does not fit by the formulas"
    lay = got["theirs"]["layout"]
    assert all(lay.get(k, 1) == v for k, v in entry["layout"].items())
    assert lay["dp"] * lay["cp"] * lay["tp"] * lay["pp"] == entry["gpus"]
    assert 1 <= got["rank"] <= len(got["fits"]) and got["fits"][got["rank"] - 1] is got["theirs"]
    assert 0 < got["mfu"] <= got["first_mfu"] * (1 + 1e-9) <= entry["hardware"]["efficiency"]
    assert got["theirs"]["bytes"] <= plan.USABLE * 80e9


def test_deepseek_v3s_layout_holds_its_experts_over_ep_and_pays_the_all_to_alls():
    """DeepSeek-V3 (PP 16, EP 64 over 8 nodes, ZeRO-1, no TP): 4 of each MoE block's 256 experts on a rank, all-to-alls
    over the network (64 ranks span 8 nodes), which the model exposes in full: it has no DualPipe."""
    got = _planned(next(e for e in scale.PUBLISHED if e["name"] == "DeepSeek-V3"))["theirs"]
    middle = got["stages"][1]
    assert middle["experts"] == 4 * 4 * 3 * 7168 * 2048  # 4 MoE blocks, 4 experts each
    assert got["seconds"]["ep"] > 0 and got["seconds"]["total"] >= got["seconds"]["compute"] + got["seconds"]["ep"]
