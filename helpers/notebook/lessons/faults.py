"""Notebook 06 (fault tolerance, multi-node, debugging): what its cells print and claim about each run.

Section 1 runs ``course/elastic_cifar10.py`` twice on 2 CPU ranks with one thread each: without a fault, and with
rank 1 exiting abruptly after step :data:`FAULT_STEP` under ``--max-restarts 1``. Same code, seeds, data and kernels,
so the resumed run must end *bitwise* equal to the run without a fault; that is the claim, not a tolerance. How rank
0's first attempt ends is a race (gloo raises on the closed connection, or torchrun's agent stops it first), so the
claims accept both endings and print which one this run got. Section 2 runs the same job as 2 nodes x 1 rank. With
2 ranks the gradient all-reduce is one addition, exact in either order, so it too must end bitwise equal. Section 3
reads the stacks of a hung rank, ``TORCH_DISTRIBUTED_DEBUG=DETAIL``'s mismatch report, a process-group timeout, and
the port-29500 collision.

Example (notebook cells)::

    from helpers.notebook.lessons import faults as lesson
    story = lesson.show_fault_story(crashed)
    lesson.claim_resume(clean, crashed, story)
    lesson.claim_hang(hang)
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ...launch import PROJECT_ROOT
from ...rank import checkpoint, metrics
from ..checks import claim
from ..i18n import say

NPROC = 2  # section 1's and section 3's ranks (section 2: 2 nodes x 1)
BATCH = 32  # the harness's --batch-size, per rank
FAULT_STEP = 7  # rank 1 exits after this step ...
SNAPSHOT_EVERY = 5  # ... so the newest snapshot before it is step 5's
MIN_STEPS = 10  # the fault needs step 5's snapshot before it and steps after it


def plan(profile: str, train_size: int, test_size: int) -> None:
    """Print what section 1's runs train; refuse a TRAIN_SIZE too small for the fault after step 7 to come after a
    snapshot and before the end."""
    per_epoch = train_size // (BATCH * NPROC)
    if 2 * per_epoch < MIN_STEPS:
        raise ValueError(f"TRAIN_SIZE={train_size} gives {2 * per_epoch} steps in 2 epochs at {BATCH * NPROC} images "
                         f"per step; this chapter needs at least {MIN_STEPS}: set TRAIN_SIZE to "
                         f"{MIN_STEPS // 2 * BATCH * NPROC} or more")
    print(f"profile {profile}: {train_size} training images = {per_epoch} steps per epoch at {BATCH} per rank x "
          f"{NPROC} ranks; 2 epochs = {2 * per_epoch} steps, snapshot every {SNAPSHOT_EVERY}; {test_size} test "
          f"images for the final accuracy")


def _sites() -> set[str]:
    import torch

    sites = {str(Path(torch.__file__).parents[1]), str(Path(torch.__file__).resolve().parents[1])}
    for root in (PROJECT_ROOT, PROJECT_ROOT.resolve()):  # as the launcher's messages show them, relative to the root
        sites |= {str(Path(s).relative_to(root)) for s in list(sites) if Path(s).is_relative_to(root)}
    return sites


def tidy(text: str, sites: set[str] | None = None) -> str:
    """Paths as any reader would see them: installed packages under ``<site-packages>``, the course's files relative
    to its root, and PyTorch's build-machine prefix dropped."""
    for site in sorted(_sites() if sites is None else sites, key=len, reverse=True):
        text = text.replace(site + "/", "<site-packages>/")
    for root in {str(PROJECT_ROOT), str(PROJECT_ROOT.resolve())}:
        text = text.replace(root + "/", "")
    return text.replace("/__w/pytorch/pytorch/", "")


# --- section 1: snapshot, crash, resume -----------------------------------------------------------------------------

@dataclass(frozen=True)
class FaultStory:
    """What the two ranks' logs of the faulty run say: rank 1's fault line, how rank 0's attempt 0 ended (the
    error line of its traceback, or None: stopped by torchrun before gloo raised), and attempt 1's lines."""

    fault: str
    traceback_lines: int | None
    error: str | None
    attempt1: list[str]

    @property
    def ending(self) -> str:
        if self.error is None:
            return "no traceback: torchrun stopped it before gloo raised"
        return f"a {self.traceback_lines}-line traceback ending in {self.error[:120]} ..."

    @property
    def ended_without_hanging(self) -> bool:
        return self.fault.endswith(f"after step {FAULT_STEP}") and (self.error is None or "Error" in self.error)


KEPT = ("resumed from", "attempt=", "done:", "test accuracy")  # attempt 1's lines that tell the story


def fault_story(rank0_log: str, rank1_log: str) -> FaultStory:
    """Read the faulty run's story off rank 0's and rank 1's logs. Raises ValueError when a part is missing (no
    fault line, no attempt 1): then the run is not the one the lesson describes."""
    rank0, rank1 = rank0_log.splitlines(), rank1_log.splitlines()
    fault = next((line for line in rank1 if "FAULT INJECTED" in line), None)
    start = next((i for i, line in enumerate(rank0) if line.startswith("attempt 1:")), None)
    if fault is None or start is None:
        raise ValueError("the faulty run's logs lack the fault line (rank 1) or attempt 1's start (rank 0)")
    tb = next((i for i in range(start) if rank0[i].startswith("Traceback")), None)
    lines = error = None
    if tb is not None:
        at = next((i for i in range(tb + 1, start) if rank0[i] and not rank0[i].startswith(" ")), None)
        if at is not None:
            lines, error = at - tb + 1, rank0[at]
    return FaultStory(fault, lines, error, [line for line in rank0[start:] if any(k in line for k in KEPT)])


def show_fault_story(crashed) -> FaultStory:
    """Print the faulty run's story (each rank's lines that tell it; whole logs in the run folder) and return it."""
    story = fault_story(crashed.log(0), crashed.log(1))
    sites = _sites()
    print(f"rank 1, attempt 0: {story.fault}")
    print(f"rank 0, attempt 0: ended (measured: {tidy(story.ending, sites)})")
    print("rank 0, attempt 1 (new processes, started by torchrun):")
    for line in story.attempt1:
        line = tidy(line, sites).replace(crashed.run_dir.name, "<run>")
        if line.startswith("test accuracy"):  # the digits follow the CPU's float kernels; the claim below compares
            line = re.sub(r"test accuracy (\S+)", r"test accuracy (measured: \1)", line)
        print(f"    {line}")
    return story


def _losses_after_restart(clean_records, crashed_records) -> tuple[int, bool]:
    """(how many steps attempt 1 ran, whether each of its losses on rank 0 equals the clean run's at that step)."""
    clean = dict(zip(*metrics.series(clean_records, "loss", rank=0)))
    after = [(r["step"], r["loss"]) for r in metrics.steps(crashed_records, rank=0) if r["attempt"] == 1]
    return len(after), bool(after) and all(clean.get(step) == loss for step, loss in after)


def _same_weights(path_a, path_b) -> bool:
    import torch

    a, b = torch.load(path_a, map_location="cpu"), torch.load(path_b, map_location="cpu")
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def claim_resume(clean, crashed, story: FaultStory) -> None:
    """Section 1's claims: the reference ran once, the faulty run died, restarted once and resumed from the newest
    snapshot before the fault, and it ends with the reference's losses, accuracy and weights, bit for bit."""
    c, r = clean.result, crashed.result
    claim("reference run: never restarted, never resumed", clean.restarts == 0 and c["resumed_from"] is None)
    claim(f"faulty run: rank 1 died after step {FAULT_STEP}, and rank 0's first attempt ended (an error, or stopped by "
          "torchrun) instead of hanging", story.ended_without_hanging)
    claim("faulty run: torchrun restarted the workers once", crashed.restarts == 1 and r["restart_count"] == 1)
    newest = FAULT_STEP - FAULT_STEP % SNAPSHOT_EVERY
    claim(f"faulty run: resumed from the newest snapshot before the fault, step {newest}", r["resumed_from"] == newest)
    steps, equal = _losses_after_restart(clean.metrics, crashed.metrics)
    claim("after the restart, every loss of rank 0 equals the run without a fault's, step for step", equal,
          measured=f"{steps} steps")
    claim("both ran the same number of steps and report the same test accuracy",
          c["steps"] == r["steps"] and c["test_accuracy"] == r["test_accuracy"], measured=f"{c['test_accuracy']:.4f}")
    claim("final weights bitwise equal (sha256, and torch.equal on every tensor)",
          c["final_params_sha256"] == r["final_params_sha256"] and _same_weights(c["checkpoint"], r["checkpoint"]))


def plot_resume(clean, crashed) -> None:
    """Rank 0's loss per step: the run without a fault as a wide grey line, the faulty run's attempts on top (drawn
    on a new figure, which the notebook shows)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8))
    ax.plot(*metrics.series(clean.metrics, "loss", rank=0), "-", color="0.6", lw=5, alpha=0.5,
            label="no fault (one attempt)", zorder=1)
    styles = {0: dict(color="tab:red", marker="x", ls="--", ms=7),
              1: dict(color="tab:blue", marker="o", ls=":", ms=4, mfc="none")}
    by_attempt: dict[int, list] = {}
    for rec in metrics.steps(crashed.metrics, rank=0):
        by_attempt.setdefault(rec["attempt"], []).append((rec["step"], rec["loss"]))
    for attempt, points in sorted(by_attempt.items()):
        what = "until rank 1 died" if attempt == 0 else "after the restart, from the snapshot"
        ax.plot(*zip(*points), lw=1, zorder=2, label=f"rank 1 killed after step {FAULT_STEP}: attempt {attempt}, "
                f"{what}", **styles[attempt % 2])
    newest = FAULT_STEP - FAULT_STEP % SNAPSHOT_EVERY
    ax.axvline(newest, color="k", ls=":", lw=1)
    ax.annotate(f" snapshot of step {newest}", (newest, ax.get_ylim()[0]), fontsize=8, ha="left", va="bottom")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss of rank 0 (cross-entropy)")
    ax.set_title("the resumed run retraces the run without a fault")
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(alpha=0.3)
    fig.tight_layout()


def newest_kept(steps: int, every: int, keep: int = 2) -> list[int]:
    """The snapshot steps a run of ``steps`` steps leaves on disk, snapshotting every ``every`` and keeping the
    newest ``keep``."""
    made = list(range(every, steps + 1, every))
    return made[-keep:]


def claim_snapshots(crashed, every: int = SNAPSHOT_EVERY, keep: int = 2) -> None:
    """Print the snapshot files the faulty run left, and claim they are the newest ``keep`` and the newest loads."""
    folder = Path(crashed.result["checkpoint"]).parent / "snapshots"
    snaps = checkpoint.list_snapshots(folder)
    print([p.name for p in snaps])
    found = [checkpoint.snapshot_step(p) for p in snaps]
    expected = newest_kept(crashed.result["steps"], every, keep)
    claim(f"the script keeps the newest {keep} snapshots, and the newest loads",
          found == expected and checkpoint.load_snapshot(snaps[-1])["step"] == expected[-1], measured=f"{found}")


# --- section 2: two nodes -------------------------------------------------------------------------------------------

def claim_two_nodes(two_nodes, clean) -> None:
    """Each rank's world size, steps and resume point; and that 2 nodes x 1 rank ends with 1 node x 2 ranks'
    weights, bit for bit (2 ranks: the all-reduce is one addition, exact in either order)."""
    for rank, res in two_nodes.results_by_rank().items():
        print(rank, {k: res[k] for k in ("world_size", "steps", "resumed_from")})
    t, c = two_nodes.result, clean.result
    claim("two nodes x 1 rank: world size 2, like the single-node run", t["world_size"] == c["world_size"] == 2)
    claim("same final weights as 1 node x 2 ranks, bit for bit", t["final_params_sha256"] == c["final_params_sha256"])


# --- section 3: debugging -------------------------------------------------------------------------------------------

STACK = "--- Python stack of rank "


def stacks(message: str) -> list[str]:
    """The per-rank Python stacks a stalled launch's error carries, in rank order (each starts with its rank)."""
    return message.split(STACK)[1:]


def show_stacks(err) -> None:
    """Print the stacks of every rank of a stalled launch, paths tidied (headers in the notebook's language)."""
    text = str(err)
    say(tidy(text[text.find(STACK):text.find("run dir:")]))


def claim_hang(err) -> None:
    """The collective-inside-``if rank == 0`` run: stopped as stalled, each rank's last words and innermost
    collective."""
    found = stacks(str(err)) + [""] * NPROC  # a missing stack reads as empty: its claim says False
    logs = {r: (Path(err.run_dir) / f"rank{r}.log").read_text() for r in range(NPROC)}
    claim("the launcher stopped the run as stalled and collected a stack for every rank",
          err.reason == "stalled" and all(found[:NPROC]) and not any(found[NPROC:]))
    claim("rank 0's last words: all_reduce for the log line; its stack ends inside all_reduce",
          "all_reduce for the log line" in logs[0] and found[0].startswith("0") and "in all_reduce" in found[0])
    claim("rank 1's last words: waiting at the barrier (never past it); its stack ends inside barrier",
          "waiting at the barrier" in logs[1] and "past the barrier" not in logs[1]
          and found[1].startswith("1") and "in barrier" in found[1])


def claim_fixed(run) -> None:
    """The same script with ``--fixed``: print what the ranks said; it finished, rank 0 printed the mean loss of
    ranks 0 and 1 (losses 1 and 2), and every rank passed the barrier."""
    logs = [run.log(r) for r in range(NPROC)]
    for r, log in enumerate(logs):
        print(f"rank {r}'s log:", " | ".join(l for l in log.splitlines() if l.startswith(("mean loss", "rank "))))
    claim("with --fixed the run finishes: rank 0 logs the mean loss 1.50, every rank passes the barrier",
          run.returncode == 0 and "mean loss 1.50" in logs[0] and all("past the barrier" in log for log in logs))


FINGERPRINT = re.compile(r"Rank (\d+) is running collective: CollectiveFingerPrint\(SequenceNumber=\d+,? ?OpType=(\w+)")


def mismatch(message: str) -> tuple[str | None, list[tuple[str, str]]]:
    """DETAIL's first "Detected mismatch" line, and every (rank, collective) it found a rank running."""
    line = next((l for l in message.splitlines() if "Detected mismatch" in l), None)
    return line, sorted(set(FINGERPRINT.findall(message)))


def show_mismatch(err) -> None:
    """Print DETAIL's first mismatch line and what it found each rank running (which rank notices first varies)."""
    line, seen = mismatch(str(err))
    print((line or "")[:160] + " ...")
    print("ranks and the collectives they were running:", seen)


def claim_detail(err) -> None:
    """``TORCH_DISTRIBUTED_DEBUG=DETAIL`` on the same bug: the error it raises instead of hanging."""
    line, seen = mismatch(str(err))
    claim("DETAIL turned the hang into an error that names the mismatch", err.reason == "failed" and line is not None)
    claim("rank 0 was caught in its ALLREDUCE", ("0", "ALLREDUCE") in seen)


def first_line(text: str, needle: str) -> str:
    """The first line of ``text`` containing ``needle``, stripped and with its paths tidied ("" if none)."""
    return tidy(next((l.strip() for l in str(text).splitlines() if needle in l), ""))


def claim_pg_timeout(err, seconds: int) -> None:
    """``init_process_group(timeout=seconds)`` on the same bug: gloo's collective raises after ``seconds``. Prints
    the defaults for comparison."""
    from torch.distributed import constants

    print("default collective timeouts: gloo", constants.default_pg_timeout, "| NCCL",
          constants.default_pg_nccl_timeout)
    claim(f"the process-group timeout ended the hang, after the {seconds} s it allows",
          err.reason == "failed" and f"Timed out waiting {seconds * 1000}ms" in str(err))


def claim_port(pinned, unpinned) -> None:
    """Two ``subprocess.run`` results of torchrun while port 29500 is held: pinned to it (``--master-port``), and
    without a port."""
    said = (pinned.stdout + pinned.stderr).lower()
    claim("pinned port -> 'address already in use'", pinned.returncode != 0 and "address already in use" in said)
    claim("the same single-node torchrun without --master-port picks a free port and runs", unpinned.returncode == 0)
    say("fix: on one node, do not pin the port (plain torchrun, --standalone, or helpers.launch, which picks a free "
          "port every run); across nodes, one port per job (section 2's table)")
