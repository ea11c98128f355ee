"""A sweep whose only failures are refused inputs exits 2; a run that really failed still exits 1 (issue 35 §4).

The three refusals of the kept corpus (a FIFO ``metrics.jsonl`` in an
unfinished run, a ``rejected/`` that is a link, a run folder linked outside
the sweep) each end ``flowgeom reproduce`` with one error line and exit 2
(they ended in exit 1, the code of a failed computation). The summary and
report are still written. With a real failure beside a refusal the exit is 1.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
import _sweep_fakes as fakes  # noqa: E402  (the fake claims of the sweep tests)

from flowgeom.errors import RefusedInput  # noqa: E402
from flowgeom.reproduce import registry  # noqa: E402
from tree_digest import snapshot  # noqa: E402

SEEDS = (0, 1)


@pytest.fixture
def sweep(tmp_path, cli, monkeypatch):
    """``reproduce laws --quick --out OUT --json [--resume]`` on the fake claims; returns (rc, stdout JSON, stderr)."""
    claims = [fakes.counter_claim(n=3, seeds=SEEDS)]
    monkeypatch.setattr(registry, "load_claims", lambda areas: claims)
    out = tmp_path / "sweep"

    def run(*, resume: bool, extra=()):
        claims[1:] = list(extra)
        rc, stdout, err = cli(["reproduce", "laws", "--quick", "--out", out, "--json"]
                              + (["--resume"] if resume else []))
        return rc, json.loads(stdout), err

    rc, _, _ = run(resume=False)
    assert rc == 0
    return out, run


def _runs(out: Path) -> list[Path]:
    return sorted(p.parent for p in out.glob("runs/fake.counter/*/config.json"))


def _refused_line(err: str, run: str) -> str:
    [line] = [x for x in err.splitlines() if x.strip()]
    assert line.startswith(f"flowgeom: error: 1 run(s) refused their inputs, and no run failed otherwise; first, "
                           f"fake.counter/{run}: ") and line.endswith("; fix that, then rerun with --resume")
    return line


def test_a_fifo_metrics_file_exits_2(sweep):
    out, run = sweep
    target = _runs(out)[0]
    (target / "summary.json").unlink()  # killed before the end: the resume reads metrics.jsonl
    (target / "metrics.jsonl").unlink()
    os.mkfifo(target / "metrics.jsonl")
    rc, payload, err = run(resume=True)
    assert rc == 2 and payload["sweep"]["failed"] == payload["sweep"]["refused"] == 1
    assert "is a FIFO" in _refused_line(err, target.name)


def test_a_linked_rejected_folder_exits_2(sweep, tmp_path):
    out, run = sweep
    outside = tmp_path / "outside"
    outside.mkdir()
    target = _runs(out)[0]
    summary = json.loads((target / "summary.json").read_text())
    summary["acc"] += 1  # tampered: the sweep wants to move it aside into rejected/
    (target / "summary.json").write_text(json.dumps(summary))
    (out / "rejected").symlink_to(outside)
    rc, payload, err = run(resume=True)
    assert rc == 2 and payload["sweep"]["refused"] == 1
    assert "goes through the symlink" in _refused_line(err, target.name) and not any(outside.iterdir())


def test_a_run_folder_linked_outside_exits_2(sweep, tmp_path):
    out, run = sweep
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.md").write_text("mine\n")
    target = _runs(out)[0]
    for p in sorted(target.rglob("*"), reverse=True):
        p.unlink() if p.is_file() else p.rmdir()
    target.rmdir()
    target.symlink_to(outside)  # an "unfinished run" that is a link
    before = snapshot(outside)
    rc, payload, err = run(resume=True)
    assert rc == 2 and payload["sweep"]["refused"] == 1
    assert "goes through the symlink" in _refused_line(err, target.name) and snapshot(outside) == before


def test_a_real_failure_beside_a_refusal_exits_1(sweep):
    out, run = sweep
    target = _runs(out)[0]
    (target / "summary.json").unlink()
    (target / "metrics.jsonl").unlink()
    os.mkfifo(target / "metrics.jsonl")
    rc, payload, err = run(resume=True, extra=[fakes.boom_claim()])  # x=1 raises ValueError, x=2 fills the disk
    assert rc == 1 and payload["sweep"]["failed"] == 3 and payload["sweep"]["refused"] == 1
    assert "error:" not in err
    refused = [r for r in payload["sweep"]["runs"] if r["refused"]]
    assert [r["run"] for r in refused] == [f"fake.counter/{target.name}"]


def test_refused_input_is_a_flowgeom_error_raised_for_fifos_and_links(tmp_path):
    from flowgeom.files import confined, regular_file

    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "link").symlink_to(tmp_path)
    with pytest.raises(RefusedInput, match="is a FIFO"):
        regular_file(tmp_path / "pipe", "metrics.jsonl")
    with pytest.raises(RefusedInput, match="goes through the symlink"):
        confined(tmp_path / "root", tmp_path / "root" / "link" / "x")
