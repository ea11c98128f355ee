"""report.md / report.html: content, escaping, self-containment, and a headless-Chromium render."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "experiments"))
import _sweep_fakes as fakes  # noqa: E402
from flowgeom.reproduce.pipeline import reproduce  # noqa: E402
from flowgeom.errors import FlowgeomError  # noqa: E402
from flowgeom.report.render import load, render_html, write_report  # noqa: E402

ARTIFACTS = Path(__file__).parents[2] / "test-artifacts"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("report")
    claims = [fakes.counter_claim(n=4), fakes.boom_claim(), fakes.unavailable_claim()]
    reproduce(claims, out=out, show_progress=False, areas=("laws", "conservation", "continuity"))
    return out


def test_markdown_has_every_claim_verdict_command_and_machine(report_dir):
    md = (report_dir / "report.md").read_text()
    for needle in ("fake.counter", "fake.boom", "fake.missing", "**reproduced**", "**differs**", "**not run**",
                   "flowgeom reproduce laws --quick --only fake.counter", "sum of final acc", "torch",
                   "cpu_count", "planted failure", "not importable"):
        assert needle in md, needle
    assert "with a pipe" in md and "\\|" in md  # a pipe in a table cell is escaped
    (fig,) = re.findall(r"!\[fake.counter\]\(([^)]+)\)", md)
    assert (report_dir / fig).exists()


def test_html_is_self_contained_and_escaped(report_dir):
    page = (report_dir / "report.html").read_text()
    srcs = re.findall(r'src="([^"]*)"', page)
    assert srcs and all(s.startswith("data:image/png;base64,") for s in srcs)
    png = base64.b64decode(srcs[0].split(",", 1)[1])
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<counts>" not in page and "&lt;counts&gt;" in page
    assert "<b>claim</b>" not in page and "http" not in page.replace("http-equiv", "")


def test_missing_figure_is_shown_not_crashed(report_dir, tmp_path):
    report = load(report_dir)
    report["claims"][0]["verdict"]["figures"] = ["claims/none/figures/gone.png"]
    assert "figure claims/none/figures/gone.png is missing" in render_html(report, tmp_path)
    with pytest.raises(FlowgeomError, match="not found"):
        load(tmp_path)


def _chromium(url: str, profile: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0", "--virtual-time-budget=3000", *extra, url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def _render(page: Path, profile: Path) -> tuple[str, list[str]]:
    r = _chromium(page.as_uri(), profile, "--dump-dom")
    assert r.returncode == 0, r.stderr[-2000:]
    (body,) = re.findall(r"<body[^>]*>", r.stdout)
    console = [line for line in r.stderr.splitlines() if ":CONSOLE" in line]
    return body, console


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (apt-get install -y chromium)")
def test_report_renders_in_headless_chromium(report_dir, tmp_path):
    page = report_dir / "report.html"
    n_img = page.read_text().count("<img ")
    assert n_img >= 1
    body, console = _render(page, tmp_path / "profile")
    assert f'data-images="{n_img}/{n_img}"' in body and 'data-images-ok="true"' in body, body
    assert console == [], console
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "report.png"
    shot.unlink(missing_ok=True)
    r = _chromium(page.as_uri(), tmp_path / "profile", f"--screenshot={shot}", "--window-size=1100,2400")
    assert r.returncode == 0 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (apt-get install -y chromium)")
def test_chromium_check_catches_a_broken_image_and_a_console_error(report_dir, tmp_path):
    report = load(report_dir)
    html = render_html(report, report_dir).replace("data:image/png;base64,", "data:image/png;base64,AAAA", 1)
    html = html.replace("<script>", "<script>console.error('planted');</script><script>", 1)
    bad = tmp_path / "bad.html"
    bad.write_text(html)
    body, console = _render(bad, tmp_path / "profile")
    assert 'data-images-ok="false"' in body
    assert any("planted" in line for line in console)


def test_write_report_rerenders_from_disk_only(report_dir, tmp_path):
    for name in ("report.json",):
        shutil.copy(report_dir / name, tmp_path / name)
    shutil.copytree(report_dir / "claims", tmp_path / "claims")
    md, page = write_report(tmp_path)
    assert md.read_text() == (report_dir / "report.md").read_text()
    assert json.loads((tmp_path / "report.json").read_text())["claims"][0]["id"] == "fake.counter"
    assert page.read_text().count("data:image/png") == (report_dir / "report.html").read_text().count("data:image/png")
