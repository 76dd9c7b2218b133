"""regen_diff tells a reviewer what a regen changed that nbval would see -- check lines and compared outputs -- and
counts the rest (timings, ports, images, ignored cells) as noise."""
import copy

import nbformat

from helpers.notebook import regen_diff


def _nb(check: str, duration: str, ignored: str):
    nb = nbformat.v4.new_notebook()
    compared = nbformat.v4.new_code_cell("...")
    compared.outputs = [nbformat.v4.new_output("stream", name="stdout", text=f"{check}\ntook {duration}\n")]
    hidden = nbformat.v4.new_code_cell("...", metadata={"tags": ["nbval-ignore-output"]})
    hidden.outputs = [nbformat.v4.new_output("stream", name="stdout", text=ignored)]
    nb.cells = [compared, hidden]
    return nb


def test_timings_and_ignored_output_are_noise_only():
    subs = regen_diff.substitutions()
    old = _nb("[check] loss fell: True", "1.2 s", "pid 123 rank0 line")
    new = _nb("[check] loss fell: True", "3.4 s", "pid 456 rank1 line")
    found = regen_diff.changes(old, new, subs)
    assert found == {"checks": [], "cells": [], "noise": 2}


def test_a_flipped_check_and_a_changed_compared_line_are_listed():
    subs = regen_diff.substitutions()
    old = _nb("[check] loss fell: True", "1.2 s", "x")
    new = copy.deepcopy(old)
    new.cells[0].outputs[0]["text"] = "[check] loss fell: False\ntook 1.2 s\n"
    found = regen_diff.changes(old, new, subs)
    assert found["checks"] == ["- loss fell: True", "+ loss fell: False"]
    assert [i for i, _ in found["cells"]] == [0] and "+[check] loss fell: False" in found["cells"][0][1]


def test_churn_counts_what_a_regen_rewrote_by_kind():
    old = _nb("[check] loss fell: True", "1.2 s", "pid 123\nrank0 line\n")
    new = _nb("[check] loss fell: True", "3.4 s", "pid 456\nrank0 line\n")
    new.cells[1].outputs.append(nbformat.v4.new_output("display_data", data={"image/png": "AAAA"}))
    new.cells[0].metadata["execution"] = {"started": "today"}
    moved = regen_diff.churn(old, new)
    # a timing in a compared cell: one line out, one in; the ignored cell's pid line likewise; one image added
    assert moved["compared"] == 2 and moved["ignored"] == 2 and moved["images"] == 1
    assert moved["metadata"] > 0 and moved["source"] == 0
    assert sum(regen_diff.churn(old, copy.deepcopy(old)).values()) == 0


def test_the_digest_of_trained_weights_is_masked_but_the_rest_of_its_line_is_compared():
    """The SHA-256 of weights trained on a CPU differs between machines (float kernels); the committed notebook 06
    prints it in a compared cell, so the substitution must find it there, and nothing else on the line."""
    subs = regen_diff.substitutions()
    line = next(l for l in (regen_diff.ROOT / "notebooks" / "06_fault_tolerance_multinode.ipynb").read_text()
                .splitlines() if "sha256 " in l and "done:" in l)
    masked = line
    for pattern, replacement in subs:
        masked = pattern.sub(replacement, masked)
    assert "sha256 <SHA256>" in masked and "resumed from 5, restarts 1" in masked
    a = _nb("done: 32 steps, sha256 2a8220caefb778ee", "1 s", "x")
    b = _nb("done: 32 steps, sha256 301026e3ad92ff5f", "1 s", "x")
    assert regen_diff.changes(a, b, subs)["cells"] == []
    c = _nb("done: 31 steps, sha256 301026e3ad92ff5f", "1 s", "x")
    assert regen_diff.changes(a, c, subs)["cells"] != []
