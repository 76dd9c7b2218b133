"""Driving one JupyterLab notebook tab with Playwright: open, wait for the kernel, run, read prompts and outputs.

Selectors are JupyterLab 4's own DOM (checked against 4.6): ``.jp-Notebook .jp-Cell`` per cell,
``.jp-InputPrompt`` reading ``[ ]:``, ``[*]:`` or ``[n]:``, ``.jp-Toolbar-kernelName`` for the kernel's display name.
"""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

EXECUTED = re.compile(r"^\[\d+\]:$")
# JupyterLab 4.6 renders an error output as text with the stderr mime type, like a warning; what tells them apart
# on screen is the traceback. The saved notebook (output_type "error") is the authoritative check.
TRACEBACK = re.compile(r"Traceback \(most recent call last\)|^\w*(Error|Exception): ", re.M)


class NotebookPage:
    def __init__(self, page, lab, path: str):
        self.page, self.lab, self.path = page, lab, path

    # ------------------------------------------------------------------ open
    def open(self, timeout_s: float = 90) -> "NotebookPage":
        self.page.goto(f"{self.lab.url}/lab/tree/{self.path}?reset", wait_until="domcontentloaded")
        self.page.wait_for_selector(".jp-NotebookPanel .jp-Notebook .jp-Cell", timeout=timeout_s * 1000)
        self.wait_for_kernel(timeout_s)
        return self

    def session(self) -> dict | None:
        return next((s for s in self.lab.api("GET", "/api/sessions") if s.get("path") == self.path), None)

    def wait_for_kernel(self, timeout_s: float = 90) -> dict:
        """The tab's kernel session has started and is idle (a Run issued earlier asks which kernel to start)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._accept_kernel_dialog()
            s = self.session()
            if s and s.get("kernel") and s["kernel"].get("execution_state") == "idle":
                self.page.wait_for_selector(".jp-NotebookPanel .jp-Notebook-ExecutionIndicator[data-status=idle]",
                                            timeout=timeout_s * 1000)
                return s
            time.sleep(0.3)
        raise TimeoutError(f"no idle kernel for {self.path} after {timeout_s:.0f}s; sessions: "
                           f"{self.lab.api('GET', '/api/sessions')}")

    def _accept_kernel_dialog(self) -> None:
        dialog = self.page.locator(".jp-Dialog")
        if dialog.count() and self.lab.label("Select Kernel") in dialog.first.inner_text():
            dialog.locator("button.jp-mod-accept").first.click()  # the preferred kernel: the notebook's own

    def shutdown_kernel(self) -> None:
        s = self.session()
        if s:
            self.lab.api("DELETE", f"/api/sessions/{s['id']}", timeout=30)

    # ------------------------------------------------------------------ reading
    @property
    def cells(self):
        return self.page.locator(".jp-NotebookPanel .jp-Notebook .jp-Cell")

    def kernel_display_name(self) -> str:
        return self.page.locator(".jp-NotebookPanel .jp-Toolbar-kernelName").first.inner_text().strip()

    def prompts(self) -> list[str]:
        return [t.strip() for t in self.page.locator(".jp-NotebookPanel .jp-Notebook .jp-CodeCell .jp-InputPrompt")
                .all_inner_texts()]

    def tracebacks_on_screen(self) -> list[str]:
        texts = self.page.locator(".jp-NotebookPanel .jp-OutputArea-output[data-mime-type='application/"
                                  "vnd.jupyter.stderr'], .jp-NotebookPanel .jp-OutputArea-output[data-mime-type="
                                  "'application/vnd.jupyter.error']").all_inner_texts()
        return [t for t in texts if TRACEBACK.search(t)]

    # ------------------------------------------------------------------ running
    def menu(self, menu: str, item: str) -> None:
        """Click a menu item by its English labels (translated into the server's interface language)."""
        menu, item = self.lab.label(menu), self.lab.label(item)
        self.page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(f"^{re.escape(menu)}$")).first.click()
        self.page.locator(".lm-Menu-itemLabel", has_text=re.compile(f"^{re.escape(item)}$")).first.click()

    def clear_outputs(self) -> None:
        """Edit > Clear Outputs of All Cells: prompts back to ``[ ]:``, so a number seen later is from this run."""
        self.menu("Edit", "Clear Outputs of All Cells")
        self.page.wait_for_function("() => ![...document.querySelectorAll('.jp-NotebookPanel .jp-InputPrompt')]"
                                    ".some(e => /\\[\\d+\\]/.test(e.textContent))")

    def run_all(self, timeout_s: float) -> float:
        """Run > Run All Cells on cleared outputs; returns seconds until the kernel settled (idle, nothing queued)."""
        self.clear_outputs()
        start = time.monotonic()
        self.menu("Run", "Run All Cells")
        self.wait_until_settled(timeout_s)
        return time.monotonic() - start

    def run_cells(self, indices: list[int], timeout_s: float) -> None:
        """Run the cells at these notebook indices, in order, each to completion (select it, Ctrl+Enter)."""
        self.clear_outputs()
        for i in indices:
            cell = self.cells.nth(i)
            cell.scroll_into_view_if_needed()
            cell.locator(".jp-InputPrompt").click()
            self.page.keyboard.press("Escape")  # command mode: the shortcut acts on the selected cell
            self.page.keyboard.press("Control+Enter")
            deadline = time.monotonic() + timeout_s
            prompt = cell.locator(".jp-InputPrompt")
            while not EXECUTED.match(prompt.inner_text().strip()):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"cell {i} of {self.path} did not finish in {timeout_s:.0f}s")
                time.sleep(0.3)
            self.wait_until_settled(timeout_s)

    def wait_until_settled(self, timeout_s: float) -> None:
        """Kernel idle, no cell queued or running, at least one cell executed: seen twice, a second apart."""
        deadline = time.monotonic() + timeout_s
        stable = 0
        while stable < 2:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.path} still running after {timeout_s:.0f}s; prompts {self.prompts()}")
            time.sleep(1)
            prompts = self.prompts()
            s = self.session()
            idle = bool(s and s["kernel"]["execution_state"] == "idle")
            settled = idle and "[*]:" not in prompts and any(EXECUTED.match(p) for p in prompts)
            stable = stable + 1 if settled else 0

    def save(self, timeout_s: float = 30) -> dict:
        """File > Save Notebook, then the notebook as written to disk (what the kernel produced, in nbformat)."""
        file = Path(self.lab.root_dir) / self.path
        before = file.stat().st_mtime_ns
        self.menu("File", "Save Notebook")
        deadline = time.monotonic() + timeout_s
        while file.stat().st_mtime_ns == before:
            self._accept_kernel_dialog()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.path} was not saved within {timeout_s:.0f}s")
            time.sleep(0.3)
        time.sleep(0.5)  # the contents API writes in one go, but give the rename a moment
        return json.loads(file.read_text())

    def screenshot(self, path: Path, element=None) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        (element or self.page).screenshot(path=str(path))
        return path
