"""Render a reproduction (``report.json``) as ``report.md`` and a self-contained ``report.html``.

The report layer reads only what the sweep wrote to disk: ``report.json``
(claims, verdicts, run counts and times, machine) and the PNG figures it
names (paths relative to the report folder). The HTML embeds every figure as
a base64 ``data:`` URI, so the one file can be mailed or archived; a small
inline script marks ``<body data-images-ok="true|false" data-images="k/n">``
once the page has loaded, which the headless-browser test reads.
"""

from __future__ import annotations

import base64
import html
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flowgeom.errors import FlowgeomError
from flowgeom.files import read_json_object, read_regular
from flowgeom.runs import atomic_write_bytes

REPORT_JSON = "report.json"
COLOURS = {"reproduced": "#1a7f37", "not reproduced": "#cf222e", "differs": "#9a6700", "not run": "#6e7781"}

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;max-width:980px;margin:2em auto;
padding:0 1em;color:#1f2328;line-height:1.45}
h1{font-size:1.6em;margin-bottom:.2em}h2{font-size:1.25em;margin-top:1.6em;border-bottom:1px solid #d0d7de}
h3{font-size:1.05em;margin:1.2em 0 .3em}
.claim{border:1px solid #d0d7de;border-radius:6px;padding:.6em 1em;margin:1em 0}
.badge{display:inline-block;color:#fff;border-radius:1em;padding:0 .7em;font-size:.85em;font-weight:600}
.seed{color:#57606a;font-style:italic}
code,pre{background:#f6f8fa;border-radius:4px;padding:.1em .3em;font-size:.9em}
table{border-collapse:collapse;font-size:.85em;margin:.5em 0}td,th{border:1px solid #d0d7de;padding:.2em .5em}
th{background:#f6f8fa}img{max-width:100%;height:auto;display:block;margin:.5em 0}
.fail{color:#cf222e}
"""

_SCRIPT = """
window.addEventListener('load', function () {
  var imgs = Array.prototype.slice.call(document.images);
  var ok = imgs.filter(function (i) { return i.complete && i.naturalWidth > 0; }).length;
  document.body.setAttribute('data-images', ok + '/' + imgs.length);
  document.body.setAttribute('data-images-ok', String(ok === imgs.length));
});
"""


def load(folder: str | os.PathLike) -> dict[str, Any]:
    path = Path(folder) / REPORT_JSON
    if not path.exists():
        raise FlowgeomError(f"{path} not found; run `flowgeom reproduce ... --out {folder}` first")
    return read_json_object(path, fix=f"run `flowgeom reproduce ... --out {folder}` again")


def _fmt_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s:.1f} s" if s < 120 else f"{s / 60:.1f} min"


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def _badge(verdict: str) -> str:
    return f'<span class="badge" style="background:{COLOURS.get(verdict, "#6e7781")}">{html.escape(verdict)}</span>'


def _machine_rows(machine: Mapping[str, Any]) -> list[tuple[str, str]]:
    return [(k, str(v)) for k, v in machine.items() if v is not None]


def _md_escape(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_markdown(report: Mapping[str, Any]) -> str:
    lines = [f"# {report['title']}", "", f"Command: `{report['command']}`  ", f"Started {report['started']} UTC, "
             f"total {_fmt_seconds(report.get('seconds'))}, backend `{report['backend']}`, scale `{report['scale']}`.", ""]
    lines += ["## Summary", "", "| claim | seed | verdict | measured |", "|---|---|---|---|"]
    for c in report["claims"]:
        v = c["verdict"]
        lines.append(f"| [{c['id']}](#{c['id'].replace('.', '')}) | {c['seed']} | **{v['verdict']}** | "
                     f"{_md_escape(v['measured'])} |")
    lines.append("")
    for area in report["areas"]:
        lines += [f"## {area}", ""]
        for c in (c for c in report["claims"] if c["area"] == area):
            lines += _md_claim(c)
    lines += ["## Machine and versions", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {_md_escape(v)} |" for k, v in _machine_rows(report["machine"])]
    lines.append("")
    if report.get("failures"):
        lines += ["## Failed runs", ""] + [f"- `{f['run']}`: {f['error']}" for f in report["failures"]] + [""]
    return "\n".join(lines)


def _md_claim(c: Mapping[str, Any]) -> list[str]:
    v = c["verdict"]
    out = [f"### {c['id']}", "", f"> {c['text']} ({c['seed_title']})", "",
           f"**Verdict: {v['verdict']}**" + (f" — {v['how']}" if v.get("how") else ""), "",
           f"Measured: {v['measured']}", ""]
    if v.get("table"):
        keys = list(v["table"][0])
        out += ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        out += ["| " + " | ".join(_md_escape(_cell(row.get(k, ""))) for k in keys) + " |" for row in v["table"]]
        out.append("")
    out += [f"![{c['id']}]({fig})" for fig in v.get("figures", [])]
    runs = f"{c['finished']} of {c['runs']} runs finished" if c["runs"] else "no runs"
    out += ["", f"Rerun: `{c['command']}` — {runs}, {_fmt_seconds(c.get('seconds'))} of run time.", ""]
    out += [f"- failed `{f['run']}`: {f['error']}" for f in c.get("failed", [])]
    return out + [""]


def _img(folder: Path, rel: str) -> str:
    path = folder / rel
    try:
        data = base64.b64encode(read_regular(path, "figure", fix="render the figures again")).decode()
    except (OSError, FlowgeomError):
        return f'<p class="fail">figure {html.escape(rel)} is missing</p>'
    return f'<img alt="{html.escape(rel)}" src="data:image/png;base64,{data}">'


def render_html(report: Mapping[str, Any], folder: str | os.PathLike) -> str:
    folder = Path(folder)
    e = html.escape
    parts = [f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{e(report['title'])}</title>"
             f"<style>{_CSS}</style></head><body>", f"<h1>{e(report['title'])}</h1>",
             f"<p>Command: <code>{e(report['command'])}</code><br>Started {e(report['started'])} UTC, total "
             f"{_fmt_seconds(report.get('seconds'))}, backend <code>{e(report['backend'])}</code>, scale "
             f"<code>{e(report['scale'])}</code>.</p>", "<h2>Summary</h2><table><tr><th>claim</th><th>seed</th>"
             "<th>verdict</th><th>measured</th></tr>"]
    for c in report["claims"]:
        parts.append(f"<tr><td><a href='#{e(c['id'])}'>{e(c['id'])}</a></td><td>{e(c['seed'])}</td>"
                     f"<td>{_badge(c['verdict']['verdict'])}</td><td>{e(c['verdict']['measured'])}</td></tr>")
    parts.append("</table>")
    for area in report["areas"]:
        parts.append(f"<h2>{e(area)}</h2>")
        for c in (c for c in report["claims"] if c["area"] == area):
            parts.append(_html_claim(c, folder))
    parts.append("<h2>Machine and versions</h2><table>")
    parts += [f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in _machine_rows(report["machine"])]
    parts.append("</table>")
    if report.get("failures"):
        parts.append("<h2>Failed runs</h2><ul>")
        parts += [f"<li class='fail'><code>{e(f['run'])}</code>: {e(f['error'])}</li>" for f in report["failures"]]
        parts.append("</ul>")
    parts.append(f"<script>{_SCRIPT}</script></body></html>")
    return "\n".join(parts)


def _html_claim(c: Mapping[str, Any], folder: Path) -> str:
    e = html.escape
    v = c["verdict"]
    out = [f"<div class='claim' id='{e(c['id'])}'><h3>{e(c['id'])} {_badge(v['verdict'])}</h3>",
           f"<p class='seed'>“{e(c['text'])}” — {e(c['seed_title'])}</p>",
           f"<p><b>Measured:</b> {e(v['measured'])}</p>"]
    if v.get("how"):
        out.append(f"<p><b>How:</b> {e(v['how'])}</p>")
    if v.get("table"):
        keys = list(v["table"][0])
        out.append("<table><tr>" + "".join(f"<th>{e(k)}</th>" for k in keys) + "</tr>")
        out += ["<tr>" + "".join(f"<td>{e(_cell(row.get(k, '')))}</td>" for k in keys) + "</tr>" for row in v["table"]]
        out.append("</table>")
    out += [_img(folder, fig) for fig in v.get("figures", [])]
    runs = f"{c['finished']} of {c['runs']} runs finished" if c["runs"] else "no runs"
    out.append(f"<p>Rerun: <code>{e(c['command'])}</code> — {runs}, {_fmt_seconds(c.get('seconds'))} of run time.</p>")
    out += [f"<p class='fail'>failed <code>{e(f['run'])}</code>: {e(f['error'])}</p>" for f in c.get("failed", [])]
    return "\n".join(out) + "</div>"


def write_report(folder: str | os.PathLike) -> tuple[Path, Path]:
    """Render ``folder/report.json`` to ``report.md`` and ``report.html``; returns their paths."""
    folder = Path(folder)
    report = load(folder)
    md, page = folder / "report.md", folder / "report.html"
    atomic_write_bytes(md, render_markdown(report).encode())
    atomic_write_bytes(page, render_html(report, folder).encode())
    return md, page
