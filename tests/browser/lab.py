"""A throwaway JupyterLab server on a copy of the course, and the Chromium flags this machine needs.

Used by ``tests/test_browser.py``; also runnable by hand to look at what the test sees::

    .venv/bin/python -m tests.browser.lab      # prints the URL, Ctrl-C stops server and kernels
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from helpers import launch

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
# Debian's Chromium as root on a closed network: no sandbox, no GPU, and none of the background connections
# (updates, sync, QUIC) that the network would refuse (see the machine notes). Playwright adds --headless and
# a fresh --user-data-dir of its own for every launch.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# User settings for this server only: every cell attached to the DOM (windowing would leave off-screen cells out,
# and the test counts prompts and outputs), and no news or update checks reaching for the internet.
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                        "checkForUpdates": False},
}


TRANSLATION_SETTINGS = "@jupyterlab/translation-extension/plugin.jupyterlab-settings"  # what `make lab-zh` writes


def interface_labels(locale: str | None) -> dict[str, str]:
    """English label -> the label JupyterLab shows in ``locale``, from the installed language pack (empty: English)."""
    if not locale:
        return {}
    import importlib.util
    spec = importlib.util.find_spec(f"jupyterlab_language_pack_{locale}")
    if spec is None:
        raise RuntimeError(f"no JupyterLab language pack for {locale} (pip install jupyterlab-language-pack-{locale})")
    path = Path(spec.origin).parent / "locale" / locale / "LC_MESSAGES" / "jupyterlab.json"
    return {k: v[0] for k, v in json.loads(path.read_text()).items() if isinstance(v, list) and v and v[0]}


def copy_course(dest: Path) -> Path:
    """The course's notebooks and scripts under ``dest`` (the server's root), as a learner's checkout has them."""
    for name in ("notebooks", "course"):
        shutil.copytree(ROOT / name, dest / name, ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
    return dest


class JupyterLab:
    """``jupyter lab`` from the course's .venv, in its own process session, token-less on 127.0.0.1."""

    def __init__(self, root_dir: Path, state_dir: Path, log_path: Path, locale: str | None = None):
        self.root_dir, self.state_dir, self.log_path = Path(root_dir), Path(state_dir), Path(log_path)
        self.locale, self.labels = locale, interface_labels(locale)
        self.port = launch.free_port()  # below the ephemeral range: see its docstring
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self._log = None

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout: float = 120) -> "JupyterLab":
        settings = self.state_dir / "settings"
        wanted = dict(LAB_SETTINGS, **({TRANSLATION_SETTINGS: {"locale": self.locale}} if self.locale else {}))
        for rel, values in wanted.items():
            path = settings / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values))
        env = dict(os.environ,
                   JUPYTERLAB_SETTINGS_DIR=str(settings),
                   JUPYTERLAB_WORKSPACES_DIR=str(self.state_dir / "workspaces"),
                   JUPYTER_RUNTIME_DIR=str(self.state_dir / "runtime"),
                   PYTHONUNBUFFERED="1")
        jupyter = Path(sys.executable).parent / "jupyter"  # .venv/bin: finds the dtfz kernel installed --sys-prefix
        cmd = [str(jupyter), "lab", "--no-browser", "--IdentityProvider.token=", "--ServerApp.password=",
               "--ServerApp.ip=127.0.0.1", f"--port={self.port}", "--ServerApp.port_retries=0",
               f"--ServerApp.root_dir={self.root_dir}", "--LabApp.news_url=", "--allow-root",
               "--ServerApp.disable_check_xsrf=True"]  # token-less REST calls (kernel shutdown) from the test
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=self.root_dir, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                self.api("GET", "/api/status")
                self.api("GET", "/lab")
                return self
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.5)
        raise TimeoutError(f"jupyter lab did not answer on {self.url} within {timeout:.0f}s:\n{self.log_tail()}")

    def label(self, english: str) -> str:
        """A menu or dialog label as this server's interface shows it."""
        return self.labels.get(english, english)

    def stop(self) -> None:
        """Shut kernels and server down politely, then kill whatever of theirs is still alive (by pid)."""
        if self.proc is None:
            return
        import psutil
        try:
            started = psutil.Process(self.proc.pid).children(recursive=True)  # kernels run in their own sessions
        except psutil.NoSuchProcess:
            started = []
        if self.proc.poll() is None:
            try:
                for kernel in self.api("GET", "/api/kernels"):
                    self.api("DELETE", f"/api/kernels/{kernel['id']}", timeout=20)
                self.api("POST", "/api/shutdown", timeout=10)
                self.proc.wait(timeout=20)
            except Exception:  # noqa: BLE001 -- the kills below are the fallback
                pass
        if self.proc.poll() is None:
            with _suppress_missing():
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with _suppress_missing():
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        for child in started:
            with _suppress_missing():
                if child.is_running():
                    child.kill()
        psutil.wait_procs(started, timeout=10)
        if self._log:
            self._log.close()
        self.proc = None

    def __enter__(self) -> "JupyterLab":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ helpers
    def api(self, method: str, path: str, timeout: float = 5):
        req = urllib.request.Request(self.url + path, method=method,
                                     data=b"" if method in ("POST", "DELETE") else None)
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read()
        ctype = resp.headers.get("Content-Type", "")
        return json.loads(body) if body and "json" in ctype else body

    def kernels(self) -> list[dict]:
        return self.api("GET", "/api/kernels")

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text()[-chars:]
        except OSError:
            return ""


class _suppress_missing:
    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        import psutil
        return kind is not None and issubclass(kind, (ProcessLookupError, psutil.NoSuchProcess, PermissionError))


def make_notebook(path: Path, cells: list[tuple[str, list[str]]], kernel: str = "dtfz",
                  display_name: str = "Python (distributed course)") -> Path:
    """Write a small notebook of code cells ``(source, tags)`` for the course kernel."""
    import nbformat
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": kernel, "display_name": display_name, "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(src, metadata={"tags": tags} if tags else {}) for src, tags in cells]
    nbformat.write(nb, str(path))
    return path


if __name__ == "__main__":
    import tempfile
    with tempfile.TemporaryDirectory(prefix="dtfz-lab-") as tmp:
        tmp = Path(tmp)
        (tmp / "root").mkdir()
        copy_course(tmp / "root")
        with JupyterLab(tmp / "root", tmp / "state", tmp / "lab.log") as lab:
            print(lab.url, flush=True)
            try:
                while True:
                    time.sleep(1)
            except KeyboardInterrupt:
                pass
