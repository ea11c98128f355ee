"""Writes never follow a planted symlink out of the folder being written (``runs.confined``).

* ``--export DEST``: a link at ``DEST/report.md`` (or a linked sub-folder)
  used to carry the copy onto the link's target.
* A sweep's ``rejected/`` planted as a link: moving a tampered run aside (and
  the ``rmtree`` before it) went outside the sweep.
* An unfinished run folder planted as a link: the resumed run wrote into it.

Each case: refused by name, and the file or folder outside is byte-identical.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from flowgeom.errors import FlowgeomError
from flowgeom.reproduce.export import export_results
from flowgeom.runs import confined

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "experiments"))
import _sweep_fakes as fakes  # noqa: E402  (the fake claims of the sweep tests)

from flowgeom.reproduce.sweep import plan, run_sweep  # noqa: E402
from tree_digest import snapshot  # noqa: E402  (tests/hostile is on sys.path)

SEEDS = (0, 1)


def _sweep(out: Path, *, resume: bool) -> dict:
    specs = plan([fakes.counter_claim(n=4, seeds=SEEDS)], scale="quick", out=out)
    return run_sweep(specs, resume=resume).as_dict()


@pytest.fixture
def outside(tmp_path) -> Path:
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "precious.md").write_text("not yours\n")
    return folder


def _sweep_folder(tmp_path: Path) -> Path:
    out = tmp_path / "sweep"
    (out / "runs" / "c" / "r").mkdir(parents=True)
    (out / "report.json").write_text("{}\n")
    (out / "report.md").write_text("# report\n")
    (out / "runs" / "c" / "r" / "summary.json").write_text('{"acc": 1}\n')
    return out


def test_export_refuses_a_planted_file_link(tmp_path, outside):
    out, dest = _sweep_folder(tmp_path), tmp_path / "export"
    dest.mkdir()
    (dest / "report.md").symlink_to(outside / "precious.md")
    before = snapshot(outside)
    with pytest.raises(FlowgeomError) as info:
        export_results(out, dest)
    assert str(info.value) == (f"--export file {dest / 'report.md'} goes through the symlink {dest / 'report.md'} "
                               f"(-> {outside / 'precious.md'}); flowgeom never writes through a link out of "
                               f"{dest}: remove the link")
    assert snapshot(outside) == before


def test_export_refuses_a_planted_folder_link(tmp_path, outside):
    out, dest = _sweep_folder(tmp_path), tmp_path / "export"
    dest.mkdir()
    (dest / "runs").symlink_to(outside)
    before = snapshot(outside)
    with pytest.raises(FlowgeomError, match=f"goes through the symlink {dest / 'runs'} "):
        export_results(out, dest)
    assert snapshot(outside) == before and sorted(p.name for p in outside.iterdir()) == ["precious.md"]


def test_export_without_links_copies(tmp_path):
    out, dest = _sweep_folder(tmp_path), tmp_path / "export"
    result = export_results(out, dest)
    assert sorted(result["copied"]) == ["report.json", "report.md", "runs/c/r/summary.json"]
    assert (dest / "runs" / "c" / "r" / "summary.json").read_text() == '{"acc": 1}\n'
    assert json.loads((dest / "EXPORT.json").read_text())["copied"] == 3


def test_a_planted_rejected_link_is_not_followed(tmp_path, outside):
    out = tmp_path / "sweep"
    assert _sweep(out, resume=False)["finished"] == len(SEEDS)
    run = sorted(out.glob("runs/fake.counter/*/summary.json"))[0].parent
    summary = json.loads((run / "summary.json").read_text())
    summary["acc"] += 1  # tampered: the sweep wants to move it aside into rejected/
    (run / "summary.json").write_text(json.dumps(summary))
    (out / "rejected").symlink_to(outside)
    (outside / "fake.counter" / run.name).mkdir(parents=True)
    (outside / "fake.counter" / run.name / "keep.txt").write_text("mine\n")
    before = snapshot(outside)
    result = _sweep(out, resume=True)
    assert result["failed"] == 1 and snapshot(outside) == before
    [failed] = [r for r in result["runs"] if r["status"] == "failed"]
    root = out.resolve()
    aside = root / "rejected" / "fake.counter" / run.name
    assert failed["error"].startswith("its results cannot be trusted (summary.json changed")
    assert failed["error"].endswith(f") and it cannot be moved aside: rejected folder {aside} goes through the symlink "
                                    f"{root / 'rejected'} (-> {outside}); flowgeom never writes through a link out "
                                    f"of {root}: remove the link")
    assert json.loads((run / "summary.json").read_text()) == summary  # left in place, not reused silently


def test_a_planted_run_folder_link_is_not_written(tmp_path, outside):
    out = tmp_path / "sweep"
    specs = plan([fakes.counter_claim(n=4, seeds=SEEDS)], scale="quick", out=out)
    specs[0].path.parent.mkdir(parents=True)
    specs[0].path.symlink_to(outside)  # an "unfinished run" that is a link
    before = snapshot(outside)
    result = run_sweep(specs, resume=True).as_dict()
    assert (result["finished"], result["failed"]) == (len(SEEDS) - 1, 1)
    assert result["runs"][0]["error"] == (f"run folder {specs[0].path} goes through the symlink {specs[0].path} "
                                          f"(-> {outside}); flowgeom never writes through a link out of "
                                          f"{specs[0].path.parents[2]}: remove the link")
    assert snapshot(outside) == before and sorted(p.name for p in outside.iterdir()) == ["precious.md"]


def test_confined_accepts_plain_paths_and_a_linked_root(tmp_path, outside):
    (tmp_path / "root").symlink_to(outside)  # the root itself is the user's choice
    assert confined(tmp_path / "root", tmp_path / "root" / "a" / "b.json") == tmp_path / "root" / "a" / "b.json"
    with pytest.raises(FlowgeomError, match="is not inside"):
        confined(tmp_path / "root", tmp_path / "elsewhere.json")
