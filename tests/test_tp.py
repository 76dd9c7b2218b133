"""Tensor parallelism: the communication formula (helpers/calc/tp.py), the degree rules that need another flag
(helpers/calc/mesh.py, read by the launcher with LAUNCH_DEFAULTS), and course/gpt_tp.py's own refusal, called in
this process (notebook 09 launches the script and claims its parity and counts under nbval)."""
from __future__ import annotations

import pytest

from helpers import launch
from helpers.calc import mesh, tp
from helpers.launch import Machine
from helpers.launch.spec import _given_flags, _launch_defaults, _launch_rules

SCRIPT = launch.PROJECT_ROOT / "course" / "gpt_tp.py"
CPU = Machine(gpus=0, cpus=8)


# ---------------------------------------------------------------------------------------------- formula


@pytest.mark.parametrize("n_layer", [1, 2, 5])
def test_plain_tp_all_reduces_twice_per_layer_each_way_and_nothing_else(n_layer):
    calls = tp.tp_collectives(n_layer, 4, sp=False)
    assert calls == {"forward": {"all_reduce": 2 * n_layer}, "backward": {"all_reduce": 2 * n_layer}, "grad_sync": {}}


def test_sequence_parallel_swaps_all_reduces_for_gathers_and_scatters_plus_the_edges():
    calls = tp.tp_collectives(3, 2, sp=True)
    assert calls["forward"] == {"all_gather": 7, "reduce_scatter": 6}  # + ln_f's output to the replicated head
    assert calls["backward"] == {"all_gather": 7, "reduce_scatter": 6}  # + the embeddings' gradient
    assert calls["grad_sync"] == {"all_reduce": 14}  # weight and bias of 2 x 3 + 1 LayerNorms
    assert tp.per_layer(2, True) == {"forward": {"all_gather": 2, "reduce_scatter": 2},
                                      "backward": {"all_gather": 2, "reduce_scatter": 2},
                                      "grad_sync": {"all_reduce": 4}}


def test_one_rank_sends_nothing():
    for sp in (False, True):
        assert tp.tp_collectives(2, 1, sp) == {p: {} for p in tp.PHASES}


def test_sp_sends_tp_bytes_on_a_ring_and_one_and_a_half_times_on_gloo():
    for n in (2, 3, 4, 8):
        ring_tp, ring_sp = (tp.activation_bytes_per_step(2, 8, 48, 96, n, sp) for sp in (False, True))
        assert ring_tp == pytest.approx(ring_sp)
        assert tp.gloo_bytes_per_step(2, 8, 48, 96, n, True) == pytest.approx(1.5 * ring_tp)
    # 4 all-reduces per layer, each 2 (N-1)/N of b s h elements
    assert tp.activation_bytes_per_step(1, 2, 3, 4, 2, False, 1) == 4 * 2 * 0.5 * 24


def test_shard_shapes_split_the_named_dimension_or_refuse_an_uneven_split():
    assert tp.shard_shape((384, 96), 0, 3) == (128, 96)
    assert tp.shard_shape((96, 384), 1, 4) == (96, 96)
    assert tp.shard_shape((29, 96), None, 4) == (29, 96)
    with pytest.raises(ValueError, match="does not split"):
        tp.shard_shape((29, 96), 0, 3)
    assert tp.shard_dim("blocks.1.attn.q.weight") == 0 and tp.shard_dim("blocks.0.mlp.down.weight") == 1
    assert tp.shard_dim("tok_emb.weight") is None and tp.shard_dim("blocks.0.ln1.weight") is None


# ---------------------------------------------------------------------------------------------- rules


def test_heads_rule_reads_the_tp_degree_from_the_other_flag_or_the_world():
    assert mesh.heads_split_over_tp("--n-head", "12", 4, {}) is None
    assert mesh.heads_split_over_tp("--n-head", "12", 8, {"--tp": "4"}) is None
    assert "do not split over --tp 8" in mesh.heads_split_over_tp("--n-head", "12", 8, {})
    assert "use --n-head 4, 8, 12" in mesh.heads_split_over_tp("--n-head", "6", 4, {"--tp": "4"})
    assert "whole number" in mesh.heads_split_over_tp("--n-head", "many", 4, {})


def test_sequence_rule_applies_only_under_sp():
    assert mesh.sequence_splits_over_tp("--seq-len", "64", 3, {}) is None
    assert "drop --sp" in mesh.sequence_splits_over_tp("--seq-len", "64", 3, {"--sp": ""})
    assert mesh.sequence_splits_over_tp("--seq-len", "48", 3, {"--sp": ""}) is None
    assert mesh.sequence_splits_over_tp("--seq-len", "64", 6, {"--sp": "", "--tp": "2"}) is None


def test_old_three_argument_rules_still_work():
    assert mesh.divides_world_size("--shard-size", "2", 4) is None
    assert mesh.shard_size_problem(2, 4).startswith("--shard-size 4 does not divide")


def test_given_flags_map_switches_to_empty_values():
    assert _given_flags(["--sp", "--tp", "2", "--seq-len=64", "--x"]) == {"--sp": "", "--tp": "2",
                                                                           "--seq-len": "64", "--x": ""}


def test_launch_defaults_are_read_without_running_the_script(tmp_path):
    path = tmp_path / "s.py"
    path.write_text('import sys\nLAUNCH_RULES = {"--n-head": "heads_split_over_tp"}\n'
                    'LAUNCH_DEFAULTS = {"--n-head": "6"}\nsys.exit("never run")\n')
    assert _launch_defaults(path) == {"--n-head": "6"}
    # a default is checked even when the flag is not given: 6 heads on 4 ranks
    with pytest.raises(launch.LaunchError, match="--n-head 6 heads do not split over --tp 4"):
        launch.LaunchSpec.check("torchrun", path, 4, [], machine=CPU)
    assert launch.LaunchSpec.check("torchrun", path, 3, [], machine=CPU).nproc == 3
    path.write_text('LAUNCH_RULES = {"--n-head": "heads_split_over_tp"}\nLAUNCH_DEFAULTS = {"--n-head": 6}\n')
    with pytest.raises(launch.LaunchError, match="line 2: LAUNCH_DEFAULTS must be a literal dict"):
        launch.LaunchSpec.check("torchrun", path, 2, [], machine=CPU)


def test_the_tp_script_declares_its_rules_and_its_defaults_match_its_parser(monkeypatch):
    import course.gpt_tp as script

    assert _launch_rules(SCRIPT) == script.LAUNCH_RULES
    assert _launch_defaults(SCRIPT) == script.LAUNCH_DEFAULTS
    monkeypatch.setattr("sys.argv", ["gpt_tp.py"])
    args = script.parse_args()
    assert {f: str(getattr(args, f[2:].replace("-", "_"))) for f in script.LAUNCH_DEFAULTS} == script.LAUNCH_DEFAULTS


@pytest.mark.parametrize("nproc, args, problem", [
    (4, ["--tp", "3"], "--tp 3 does not divide the 4 ranks"),
    (4, ["--n-head", "6"], "--n-head 6 heads do not split over --tp 4"),
    (5, [], "--n-head 12 heads do not split over --tp 5"),
    (4, ["--tp", "2", "--n-head", "3"], "--n-head 3 heads do not split over --tp 2"),
    (3, ["--sp", "--seq-len", "64"], "--seq-len 64 does not split over --tp 3 ranks under --sp"),
    (4, ["--sp"], None), (3, ["--seq-len", "64"], None), (4, ["--tp", "2", "--sp", "--seq-len", "50"], None),
])
def test_bad_tp_input_is_refused_before_launch_and_good_input_passes(nproc, args, problem):
    if problem is None:
        assert launch.LaunchSpec.check("torchrun", SCRIPT, nproc, args, machine=CPU).nproc == nproc
        return
    with pytest.raises(launch.LaunchError, match=problem) as e:
        launch.LaunchSpec.check("torchrun", SCRIPT, nproc, args, machine=CPU)
    assert " use " in str(e.value)


# ---------------------------------------------------------------------------------------------- real ranks


def test_the_script_refuses_the_same_input_inside_its_ranks_from_a_terminal(refused_in_rank):
    assert "--n-head 3 heads do not split over --tp 2" in refused_in_rank(SCRIPT, ["--n-head", "3", "--steps", "1"])
