"""The one-page course report `make course` writes: every notebook's status and duration, then its headlines.

Each row also links the notebook's Chinese edition, built from the same executed copy (nothing runs twice).

A headline is the output of a code cell tagged ``headline`` (a measured table, a verdict, a plot), taken from the
executed copy in ``build/notebooks/``. The page is self-contained HTML (plots embedded), so it can be mailed or
archived as it is.

Example::

    python -m helpers course        # writes build/report.html at the end
"""
from __future__ import annotations

import html
import time
from pathlib import Path

import nbformat

STATUS_COLOURS = {"ok": "#1a7f37", "SLOW": "#9a6700", "FAILED": "#cf222e"}


def headline_outputs(nb_path: Path) -> list[tuple[str, str]]:
    """(kind, payload) pairs of the headline cells' outputs: ("text", str) or ("png", base64)."""
    if not nb_path.exists():
        return []
    nb = nbformat.read(nb_path, as_version=4)
    found = []
    for cell in nb.cells:
        if cell.get("cell_type") != "code" or "headline" not in cell.get("metadata", {}).get("tags", []):
            continue
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                found.append(("text", "".join(out.get("text", ""))))
            elif out.get("output_type") in ("display_data", "execute_result"):
                data = out.get("data", {})
                if "image/png" in data:
                    found.append(("png", data["image/png"].strip()))
                elif "text/plain" in data:
                    found.append(("text", "".join(data["text/plain"])))
            elif out.get("output_type") == "error":
                found.append(("text", f"{out.get('ename')}: {out.get('evalue')}"))
    return found


def _chinese(row: dict) -> str:
    """The Chinese edition's cell: a link to the notebook built from this run, or what its catalogue still needs."""
    state = row.get("zh")
    if state is None:
        return "-"
    if state != "built":
        return html.escape(state)
    return f"<a href='notebooks/zh/{html.escape(row['notebook'])}'>{html.escape(row.get('zh_title') or 'built')}</a>"


def render(rows: list[dict], profile: str, environment: dict) -> str:
    """The report as an HTML string. ``rows`` come from :func:`helpers.notebook.runner.run_chapters`."""
    esc = html.escape
    total = sum(r["seconds"] for r in rows)
    table = "\n".join(
        f"<tr><td>{esc(r['id'])}</td><td><a href='#nb{esc(r['id'])}'>{esc(r['notebook'])}</a></td>"
        f"<td style='color:{STATUS_COLOURS.get(r['status'], '#000')};font-weight:bold'>{esc(r['status'])}</td>"
        f"<td style='text-align:right'>{r['seconds']:.1f}</td><td style='text-align:right'>{esc(r.get('checks', '-'))}</td>"
        f"<td>{esc(r.get('error') or '')}</td>"
        f"<td>{_chinese(r)}</td></tr>"
        for r in rows)
    sections = []
    for r in rows:
        parts = []
        for kind, payload in headline_outputs(Path(r["output"])):
            if kind == "png":
                parts.append(f"<img src='data:image/png;base64,{payload}' style='max-width:720px'>")
            else:
                parts.append(f"<pre>{esc(payload)}</pre>")
        body = "\n".join(parts) or "<p><em>no headline output (the notebook failed before it, or tags none)</em></p>"
        sections.append(f"<h2 id='nb{esc(r['id'])}'>{esc(r['id'])} · {esc(r['notebook'])}</h2>\n{body}")
    env_rows = "".join(f"<tr><td>{esc(str(k))}</td><td>{esc(str(v))}</td></tr>" for k, v in environment.items())
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>Distributed Training from Zero: course report</title>
<style>body{{font-family:system-ui,sans-serif;max-width:960px;margin:2em auto;padding:0 1em}}
table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:4px 8px;vertical-align:top}}
pre{{background:#f6f8fa;padding:8px;overflow-x:auto}}</style></head><body>
<h1>Course report</h1>
<p>{time.strftime('%Y-%m-%d %H:%M:%S %Z')} · profile <b>{esc(profile)}</b> · {len(rows)} notebook(s),
{sum(r['status'] == 'ok' for r in rows)} ok · {total:.0f} s in all</p>
<table><tr><th>id</th><th>notebook</th><th>status</th><th>seconds</th><th>checks True</th><th>note</th>
<th>中文版 (Chinese edition)</th></tr>
{table}</table>
<h3>Environment</h3><table>{env_rows}</table>
{''.join(sections)}
</body></html>
"""


def write(rows: list[dict], profile: str, environment: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(rows, profile, environment))
    return path
