"""The exercise checkers speak Chinese in the Chinese edition and stay byte-identical in English.

Every message and hint a checker gives is a ``helpers.notebook.i18n._`` text; ``translations/zh_CN/exercises.po``
must translate each one with the same fields. These tests read the catalogue and run a few checkers of every module;
they run nothing heavy.
"""
import re

import polib
import pytest
import torch

from helpers.notebook import exercises, i18n, translate
from helpers.notebook.exercises import env, faults, fsdp, practice, write, zero

CATALOGUE = translate.catalogue_path(i18n.EXERCISES_DOMAIN)
CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff]")
# four or more Latin words in a row: an English sentence (code such as `no_sync()` or "cuda:3" is never that long)
ENGLISH_RUN = re.compile(r"(?:[A-Za-z][A-Za-z'-]*\s+){3,}[A-Za-z][A-Za-z'-]*")


def _field_keys(template: str) -> set[str]:
    return {key for key, *_rest in i18n.fields(template)}


@pytest.fixture(scope="module")
def catalogue():
    return polib.pofile(str(CATALOGUE))


@pytest.fixture
def english(monkeypatch, tmp_path):
    """A kernel that speaks English: no COURSE_LANGUAGE, working directory not notebooks/zh."""
    monkeypatch.delenv("COURSE_LANGUAGE", raising=False)
    monkeypatch.chdir(tmp_path)


# --- (a) the catalogue covers every message -----------------------------------------------------------------------

def test_every_message_is_marked_and_found():
    sources = translate.exercise_sources()
    modules = {s.occurrence.split(":")[0] for s in sources}
    checkers = {"__init__.py", "env.py", "faults.py", "fsdp.py", "practice.py", "ranks.py", "write.py",
                "write_zero.py", "zero.py", "write_tp.py", "write_gpt.py", "write_pp.py", "write_trace.py",
                "write_cp.py", "write_moe.py", "write_scale.py"}
    # the checkers, then the widgets' labels and tables and notebook 00's verdict (translate.MARKED)
    assert modules == {f"helpers/notebook/exercises/{name}" for name in checkers} | {
        "helpers/notebook/widgets.py", "helpers/notebook/config_builder.py", "helpers/notebook/step_calculator.py",
        "helpers/notebook/env.py",
        "helpers/notebook/lessons/step.py", "helpers/notebook/lessons/comm_model.py",  # notebook 11's tables
        # notebooks 08, 09 and 10's tables and plot labels
        *(f"helpers/notebook/lessons/{name}.py" for name in ("activations", "tp", "pipeline", "schedules", "layout")),
        "helpers/notebook/lessons/cp.py",  # notebook 12's tables and plot labels
        "helpers/notebook/lessons/moe.py",  # notebook 13's
        "helpers/notebook/lessons/at_scale.py", "helpers/notebook/lessons/at_scale_plan.py"}  # notebook 14's
    assert len({s.msgid for s in sources}) > 200


def test_every_msgid_has_a_chinese_translation_with_the_same_fields(catalogue):
    entries = {e.msgid: e for e in catalogue if not e.obsolete}
    problems = []
    for source in translate.exercise_sources():
        entry = entries.get(source.msgid)
        if entry is None:
            problems.append(f"missing ({source.occurrence}): {source.msgid}")
        elif not entry.msgstr or "fuzzy" in entry.flags:
            problems.append(f"untranslated or fuzzy ({source.occurrence}): {source.msgid}")
        elif _field_keys(entry.msgstr) != _field_keys(source.msgid):
            problems.append(f"fields differ ({source.occurrence}): {sorted(_field_keys(source.msgid))} vs "
                            f"{sorted(_field_keys(entry.msgstr))}: {entry.msgstr}")
        elif not CJK.search(entry.msgstr):
            problems.append(f"no Chinese in the translation ({source.occurrence}): {entry.msgstr}")
    assert not problems, "\n".join(problems)


def test_catalogue_is_up_to_date_with_the_checkers():
    """What `python -m helpers translate` would write: nothing left to translate, nothing stale."""
    merged = translate.update(translate.exercise_sources(), CATALOGUE)
    assert translate.needs_work(merged) == []
    assert [e.msgid for e in merged if e.obsolete] == []


def test_translations_use_full_width_punctuation_and_no_english_sentences(catalogue):
    bad = []
    for e in catalogue:
        if e.obsolete or not e.msgstr:
            continue
        text = re.sub(r"\{[^}]*\}", " ", e.msgstr)
        if re.search(r"[\u4e00-\u9fff][,.:;?!()]|[,.:;?!(][\u4e00-\u9fff]", text) or ENGLISH_RUN.search(text):
            bad.append(e.msgstr)
    assert not bad, "\n".join(bad)


# --- (b) wrong and right answers, in both languages ---------------------------------------------------------------

SIZES = {"conv1": 300, "conv2": 300, "fc1": 500, "fc2": 100}


# (checker call, its English text exactly as the English notebooks and tests show it); every module has a case
CASES = {
    "global_batch right": (
        lambda: exercises.check_global_batch(64, per_rank_batch=32, world_size=2),
        "Correct: 32 samples per rank x 2 ranks x 1 micro-step = one optimizer step's global batch."),
    "global_batch wrong": (
        lambda: exercises.check_global_batch(32, per_rank_batch=32, world_size=2, accumulation=2),
        "Not yet: 32 is not the global batch.\nHint: That is what one rank's DataLoader yields. Every rank processes "
        "its own batch of that size in the same step, and DDP averages over all of them. Then count the micro-steps "
        "of gradient accumulation too."),
    "set_epoch wrong": (
        lambda: exercises.check_set_epoch("for epoch in range(3):\n    for x, y in loader:\n        step(x, y)\n"),
        "Not yet: this loop never calls set_epoch.\nHint: Without it the sampler's epoch stays 0, and every epoch "
        "shuffles the data into the same order. Which sampler method tells it the epoch has changed?"),
    "device wrong": (
        lambda: exercises.check_device("cuda:5", rank=5, local_rank=1, gpus_per_node=4),
        "Not yet: cuda:5 is not the GPU this rank drives.\nHint: That is the global RANK. This node has only cuda:0 "
        "to cuda:3; torchrun sets a second variable that counts the processes on this node only."),
    "busbw right": (
        lambda: env.check_busbw(1.75, size_bytes=1e9, seconds=1.0, world_size=8),
        "Correct: algbw = 1.000 GB/s, busbw = algbw x 2(n-1)/n = 1.750 GB/s."),
    "busbw wrong": (
        lambda: env.check_busbw(1.0, size_bytes=1e9, seconds=1.0, world_size=8),
        "Not yet: 1 GB/s is not the bus bandwidth.\nHint: That is algbw, size / time: what your program sees. busbw "
        "corrects it for how often a ring all-reduce sends each byte over the slowest link."),
    "launch wrong": (
        lambda: env.check_launch(("gloo", 4), gpus_installed=8, visible_devices="0,1,2,3", cores=64),
        "Not yet: gloo would run, but not well.\nHint: gloo can carry CUDA tensors, slowly, through the host. Which "
        "backend talks GPU to GPU?"),
    "resume right": (
        lambda: faults.check_resume_point((5, 2), snapshot_every=5, fault_step=7),
        "Correct: the newest snapshot on disk is step 5's; the restart trains steps 6 to 7 again (2 steps)."),
    "resume wrong": (
        lambda: faults.check_resume_point((20, 0), snapshot_every=5, fault_step=20, fault_rank=0),
        "Not yet: the restart does not resume from step 20.\nHint: Look at the order of the lines after each step in "
        "the script's loop: does the fault injector run before or after that step's snapshot is written?"),
    "resume right, the writer died": (
        lambda: faults.check_resume_point((15, 5), snapshot_every=5, fault_step=20, fault_rank=0),
        "Correct: rank 0 writes the snapshots, and it died after step 20 before writing that step's, so the newest on "
        "disk is step 15's; the restart trains steps 16 to 20 again (5 steps). (Had another rank died there, rank 0 "
        "could have written step 20's first: a race.)"),
    "resume race": (
        lambda: faults.check_resume_point((20, 0), snapshot_every=5, fault_step=20, fault_rank=1),
        "Correct: it depends on a race: rank 0, the only writer, may or may not finish step 20's snapshot before "
        "torchrun stops it, so the restart resumes from step 20 (nothing redone) or from step 15 (5 steps redone)."),
    "written code still an outline": (
        lambda: write.check_ring_all_reduce("def ring_all_reduce(tensor):\n    ...\n"),
        "Not yet: the function is still the exercise's outline, so nothing was launched.\nHint: Replace the ... "
        "with your lines, run the cell again, then run this check."),
    "atomic wrong": (
        lambda: faults.check_atomic_save(lambda state, path: torch.save(state, path)),
        "Not yet: a crash half-way through the second save left a corrupt file where the first one was.\nHint: "
        "Writing straight to the final name destroys the old file before the new one is complete. Write somewhere "
        "else first, and only put the finished file in place, in one step that cannot be half done."),
    "units wrong": (
        lambda: fsdp.check_sharding_units([["conv1"], ["conv2"], ["fc1"], ["fc2"]], layer_params=SIZES,
                                          budget_params=1200),
        "Not yet: every unit fits, but 4 units mean 4 all-gathers per forward; fewer would do.\nHint: Each unit is "
        "one collective per forward and per backward, and small collectives waste latency: merge neighbours as long "
        "as the merged unit still fits."),
    "units right": (
        lambda: fsdp.check_sharding_units([["conv1", "conv2"], ["fc1", "fc2"]], layer_params=SIZES,
                                          budget_params=600),
        "Correct: 2 units, the largest gathers 600 of the 600-parameter budget; no grouping that fits has fewer "
        "all-gathers."),
    "resume_batch wrong": (
        lambda: fsdp.check_resume_batch(24, global_batch=48, old_world_size=2, new_world_size=3),
        "Not yet: --batch-size 24 on 3 ranks does not continue the same global batches.\nHint: That is the old "
        "per-rank batch. With more ranks it makes every step's global batch larger, and the step count no longer "
        "lines up with the checkpoint's."),
    "warmup right": (
        lambda: practice.check_warmup_lr(0.0, step=1, lr=1e-3, warmup_steps=10),
        "Correct: DeepSpeed's step 1 runs at 0 (WarmupLR counts from the step after it is built)."),
    "smallest right": (
        lambda: zero.check_smallest_stage(None, params=1e12, world_size=8, budget_gib=80),
        "Correct: no stage fits: even ZeRO-3 needs more than the budget without offload."),
    "comm wrong": (
        lambda: zero.check_comm_multiple(2.0, stage=2, accumulation=4),
        "Not yet: 2x is not it.\nHint: Count the collectives of one optimizer step: how many gradient reductions "
        "(one per step or one per micro batch?), and what is gathered after the update."),
    "comm right": (
        lambda: zero.check_comm_multiple(4.5, stage=2, accumulation=4),
        "Correct: 4.5x: 4 gradient all-reduces per step plus an all-gather of the updated weights, half an "
        "all-reduce's bytes."),
    "state bytes right": (
        lambda: write.check_state_bytes(2013265920, layers=20, d_model=8192, tp=8, dp=16),
        "Correct: 2.013e+09 bytes: 20 blocks x 12 h² / tp = 2.013e+09 parameters on a TP rank, x 16 bytes (fp32 "
        "parameter, gradient and two AdamW moments), / dp 16."),
    "state bytes wrong": (
        lambda: write.check_state_bytes(2013265920 * 16, layers=20, d_model=8192, tp=8, dp=16),
        "Not yet: 3.221e+10 bytes is not it.\nHint: That is before FSDP2 shards them: all three states are divided "
        "over the dp ranks."),
}


@pytest.mark.parametrize("case", list(CASES))
def test_verdict_in_chinese_and_english(case, english):
    check, english_text = CASES[case]
    verdict = check()
    assert str(verdict) == english_text
    assert repr(verdict) == english_text
    assert verdict._repr_mimebundle_()["text/plain"] == english_text

    chinese = verdict.render("zh_CN")
    lines = chinese.split("\n")
    assert lines[0].startswith("正确：" if verdict.ok else "还不对："), chinese
    if verdict.hint:
        assert len(lines) == 2 and lines[1].startswith("提示："), chinese
    else:
        assert len(lines) == 1, chinese
    for line in lines:
        assert CJK.search(line.split("：", 1)[1]), line
        assert not ENGLISH_RUN.search(line), f"English left in: {line}"
    assert verdict.render("en") == english_text


# --- (c) the kernel's language ------------------------------------------------------------------------------------

def test_course_language_switches_str_to_chinese(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    verdict = exercises.check_global_batch(48, per_rank_batch=32, world_size=2)
    monkeypatch.setenv("COURSE_LANGUAGE", "zh_CN")
    text = str(verdict)
    assert text.startswith("还不对：48 不是全局 batch size。\n提示：")
    assert text == verdict.render("zh_CN")
    monkeypatch.setenv("COURSE_LANGUAGE", "en")
    assert str(verdict).startswith("Not yet: 48 is not the global batch.\nHint: ")


def test_chinese_notebook_folder_speaks_chinese(monkeypatch, tmp_path):
    monkeypatch.delenv("COURSE_LANGUAGE", raising=False)
    folder = tmp_path / "notebooks" / "zh"
    folder.mkdir(parents=True)
    monkeypatch.chdir(folder)
    assert str(env.check_busbw(1.75, size_bytes=1e9, seconds=1.0, world_size=8)).startswith("正确：")


def test_unknown_course_language_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("COURSE_LANGUAGE", "fr")
    verdict = exercises.check_global_batch(64, per_rank_batch=32, world_size=2)
    with pytest.raises(ValueError, match=r"unknown course language 'fr'.*en, zh_CN"):
        str(verdict)


# --- (d) a saved output shows the same verdict in Chinese ---------------------------------------------------------

@pytest.mark.parametrize("case", ["global_batch wrong", "busbw right", "units wrong", "comm right"])
def test_saved_output_round_trips(case, english):
    verdict = CASES[case][0]()
    saved = verdict._repr_mimebundle_()[i18n.MIME]
    assert saved["kind"] == "verdict" and saved["ok"] == verdict.ok
    assert exercises.render_saved(saved, "zh_CN") == verdict.render("zh_CN")
    assert exercises.render_saved(saved, "en") == str(verdict)


# --- (e) a translation may only use the English message's fields -------------------------------------------------

def test_translation_with_an_unknown_field_is_a_clear_key_error():
    text = i18n._("{value} is not the global batch.", value=48)
    with pytest.raises(KeyError, match=r"translation uses field \{world_size\}, which the English message does not"):
        i18n.fill("{value} 不是 {world_size} 个 rank 的全局批大小。", text.rendered)
    with pytest.raises(KeyError, match=r"\{value:g\}"):  # a different format spec is a different field
        i18n.fill("{value:g} 不是全局批大小。", text.rendered)
