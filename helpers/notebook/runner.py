"""Execute the course's notebooks with papermill: the course run, instructors' regeneration, one notebook.

The list of notebooks, their timeouts and per-profile parameters live in ``course/syllabus.yml``.
Notebooks always run on the course's own kernel (registered by ``make`` into ``.venv``), with the
notebook directory as working directory, so a machine-wide ``python3`` kernel is never used.

Example::

    python -m helpers course                # all notebooks -> build/notebooks/, summary table, build/report.html
    python -m helpers run 00 -p PROFILE full   # one notebook with an overridden parameter
    python -m helpers regen                 # in place, volatile metadata stripped (instructors)
    python -m helpers translate             # Chinese edition: update translations/zh_CN/*.po, build notebooks/zh/

``course`` and ``regen`` also build the Chinese edition from the outputs they just made (``helpers.notebook.translate``:
markdown swapped for its translation, nothing executed twice), into ``build/notebooks/zh/`` and ``notebooks/zh/``.
"""
from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import nbformat
import yaml

from . import checks

# the syllabus and its chapters (a module of their own: the Chinese build reads them without the runner)
from .syllabus import BUILD, NOTEBOOKS, ROOT, SYLLABUS, Chapter, select, syllabus  # noqa: F401


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def strip_volatile(nb) -> None:
    """Remove what changes on every run without meaning anything (papermill timings, execution stamps) and the
    cell papermill injected with this run's parameters, from an executed notebook (an nbformat node)."""
    nb.metadata.pop("papermill", None)
    # Widget state: new random model ids on every run (or a stale copy of an earlier run's progress bars), and
    # JupyterLab 4 does not render saved widget state anyway ("model not found"). Without it, an output that was a
    # widget shows its text fallback (the ConfigBuilder's repr: its choices and the config they make); running the
    # cell brings the live widget back.
    nb.metadata.pop("widgets", None)
    # the committed notebook keeps its own defaults ("auto" resolves on the reader's machine), not the
    # values this machine's profile injected
    nb.cells = [c for c in nb.cells if "injected-parameters" not in c.metadata.get("tags", [])]
    for cell in nb.cells:
        cell.metadata.pop("papermill", None)
        cell.metadata.pop("execution", None)
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if WIDGET_VIEW in data and len(data) > 1:
                del data[WIDGET_VIEW]
        if cell.metadata.get("tags") == []:
            cell.metadata.pop("tags")


def environment_record(profile: str) -> dict:
    """What produced an executed notebook: key package versions, device, profile."""
    from importlib import metadata

    from . import env

    def version(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "profile": profile,
        "gpus": env.gpu_count(),
        "cpus": env.cpu_count(),
        "backend": env.default_backend(),
        "packages": {p: version(p) for p in ("torch", "torchvision", "deepspeed", "papermill", "nbval",
                                             "ipykernel", "jupyterlab", "numpy", "matplotlib")},
    }


def execute(chapter: Chapter, output: Path, profile: str, overrides: dict, kernel: str, cell_timeout: int) -> None:
    params = dict(chapter.parameters.get(profile, {}))
    params.update(overrides)
    # the kernel inherits this: launches print what a saved output should hold (helpers.launch.session)
    os.environ.setdefault("HELPERS_OUTPUT", "saved")
    execute_notebook(chapter.path, output, parameters=params, kernel=kernel, cwd=NOTEBOOKS, cell_timeout=cell_timeout)


def execute_notebook(source: Path, output: Path, *, parameters: dict, kernel: str, cwd: Path, cell_timeout: int,
                     transport: str = "ipc") -> None:
    """Execute one notebook with papermill into ``output``, its kernel started and spoken to over ``transport``.

    "ipc" (the default, where pyzmq has it): the kernel's sockets are Unix domain sockets in a private temporary
    folder, which only this user can reach; "tcp" is jupyter_client's default, ports on 127.0.0.1 that any local
    process can connect to, about which ipykernel warns on every start ("Kernel is running over TCP without
    encryption")."""
    import papermill as pm

    output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kernel-") as sockets:
        pm.execute_notebook(str(source), str(output), parameters=parameters, kernel_name=kernel, cwd=str(cwd),
                            execution_timeout=cell_timeout, progress_bar=False, log_output=False,
                            request_save_on_cell_execute=False, **kernel_transport(transport, Path(sockets)))


def kernel_transport(transport: str, sockets: Path) -> dict:
    """nbclient's arguments for a kernel manager on ``transport``: for "ipc", its sockets' path prefix in ``sockets``
    (short, absolute: a Unix socket path has ~100 bytes at most, and the kernel runs in another working folder)."""
    import zmq
    from traitlets.config import Config

    if transport == "ipc" and (not zmq.has("ipc") or len(str(sockets)) > 80):
        transport = "tcp"  # pyzmq without IPC (Windows builds), or a temporary folder too deep for a socket path
    manager = {"transport": transport}
    if transport == "ipc":
        manager["ip"] = str(sockets / "k")
    return {"config": Config({"KernelManager": manager})}


def run_chapters(chapters: list[Chapter], *, in_place: bool, profile: str, overrides: dict,
                 out_dir: Path | None = None) -> list[dict]:
    """Execute ``chapters`` in place or into ``out_dir`` (default build/notebooks); one summary row for each."""
    settings, _ = syllabus()
    kernel = settings.get("kernel", "dtfz")
    cell_timeout = int(settings.get("cell_timeout_s", 600))
    rows = []
    for ch in chapters:
        out = ch.path if in_place else (out_dir or BUILD / "notebooks") / ch.file
        print(f"==> {ch.id} {ch.file} ({ch.title})", flush=True)
        start = time.monotonic()
        status, error = "ok", ""
        try:
            execute(ch, out, profile, overrides, kernel, cell_timeout)
        except Exception as exc:  # papermill raises PapermillExecutionError with the failing cell
            status, error = "FAILED", str(exc).strip().splitlines()[-1][:200] if str(exc).strip() else type(exc).__name__
        seconds = time.monotonic() - start
        executed = nbformat.read(out, as_version=4) if out.exists() else None
        verdicts = checks.tally(executed) if executed is not None else None
        if status == "ok" and verdicts is not None and verdicts.failed:
            status = "FAILED"
            error = f"{len(verdicts.failed)} check(s) printed False, first: {verdicts.failed[0]}"
        limit = ch.budget_s if profile == "smoke" else ch.timeout_s  # budgets are the smoke profile's, on a CPU
        if status == "ok" and seconds > limit:
            status = "SLOW"
            error = f"took {seconds:.0f}s, the syllabus's {'budget' if profile == 'smoke' else 'timeout'} is {limit}s"
        if executed is not None:
            if in_place:
                strip_volatile(executed)
            # what produced the outputs, in the notebook's own metadata: a reader finds it there, and a file
            # browser does not show it as a second file
            record = environment_record(profile)
            record.update({"notebook": ch.file, "status": status, "seconds": round(seconds, 1)})
            executed.metadata.setdefault("course", {})["environment"] = record
            nbformat.write(executed, out)
        rows.append({"id": ch.id, "notebook": ch.file, "status": status, "seconds": seconds, "error": error,
                     "checks": str(verdicts) if verdicts is not None else "-", "output": str(out)})
    return rows


def summary_table(rows: list[dict]) -> str:
    """One line per notebook: status, seconds, and its checks that printed True out of all of them."""
    width = max([len(r["notebook"]) for r in rows] + [8])
    lines = [f"{'notebook':<{width}}  {'status':<7}  {'seconds':>8}  {'checks':>7}", "-" * (width + 28)]
    for r in rows:
        lines.append(f"{r['notebook']:<{width}}  {r['status']:<7}  {r['seconds']:>8.1f}  {r.get('checks', '-'):>7}")
        if r["error"]:
            lines.append(f"    {r['error']}")
    return "\n".join(lines)


def parse_overrides(pairs: list[list[str]] | None) -> dict:
    """``-p NAME VALUE`` pairs; values are parsed as YAML so numbers and booleans keep their type."""
    out = {}
    for name, value in pairs or []:
        out[name] = yaml.safe_load(value)
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m helpers", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, helptext in (("course", "execute every notebook into build/notebooks and print a summary"),
                           ("regen", "re-execute notebooks in place (instructors), stripping volatile metadata"),
                           ("run", "execute chosen notebooks into build/notebooks"),
                           ("translate", "update the Chinese catalogues and build notebooks/zh (executes nothing)")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("notebooks", nargs="*", help="ids (00), file names or stems; default: all")
        p.add_argument("--profile", default="auto", help="auto (smoke on CPU, full on GPUs), smoke or full")
        p.add_argument("-p", "--parameter", nargs=2, action="append", metavar=("NAME", "VALUE"),
                       help="override a notebook parameter, e.g. -p NPROC 4 (the name as in the parameters cell)")
    sub.add_parser("env", help="print the environment report as JSON")
    args = parser.parse_args(argv)

    if args.command == "env":
        from . import env
        print(json.dumps(env.report(), indent=2, default=str))
        return 0

    from . import env, translate
    _, chapters = syllabus()
    chosen = select(chapters, args.notebooks)
    if args.command == "translate":
        problems = translate.translate(chosen).problems
        print("\n\n".join(problems.values()) if problems else f"Chinese edition built: {len(chosen)} notebook(s)")
        return 1 if problems else 0
    profile = env.profile(args.profile)
    if args.command == "run" and not args.notebooks:
        parser.error("run needs at least one notebook id, e.g. `python -m helpers run 00`")
    rows = run_chapters(chosen, in_place=args.command == "regen", profile=profile,
                        overrides=parse_overrides(args.parameter))
    print()
    print(f"profile: {profile}")
    print(summary_table(rows))
    # the Chinese edition of what just ran: the same outputs, translated prose (a catalogue that needs work is
    # reported and fails the command; the English notebooks are kept either way)
    ran = [c for c, r in zip(chosen, rows) if Path(r["output"]).exists()]
    edition = translate.translate(ran, english_dir=None if args.command == "regen" else BUILD / "notebooks",
                                  update_catalogues=args.command == "regen")
    problems = edition.problems
    for ch, row in zip(chosen, rows):
        if ch.id in edition.titles:
            row["zh"], row["zh_title"] = "built", edition.titles[ch.id]
        else:
            row["zh"] = problems.get(Path(ch.file).stem, "not built: the notebook did not run").splitlines()[0]
    if problems:
        print("\nChinese edition: catalogues need work (python -m helpers translate):\n" + "\n\n".join(problems.values()))
    if args.command != "regen":
        from . import report
        (BUILD / "summary.json").write_text(json.dumps(rows, indent=2) + "\n")
        env_record = environment_record(profile)
        flat = {k: v for k, v in env_record.items() if k != "packages"} | env_record["packages"]
        print(f"report: {report.write(rows, profile, flat, BUILD / 'report.html')}")
    return 0 if all(r["status"] == "ok" for r in rows) and not problems else 1


if __name__ == "__main__":
    sys.exit(main())
