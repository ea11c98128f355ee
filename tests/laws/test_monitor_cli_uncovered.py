"""Uncovered blocks reach `flowgeom conserve run`: listed in the run summary and --json, warned once per grid."""

import json
import warnings

import pytest

import flowgeom.laws.monitor as monitor_mod
from flowgeom.cli import main
from flowgeom.laws.locate import FlowgeomWarning, Located, Uncovered

FAKE = Uncovered("blocks.9.mystery", "model_type 'mystery' is not in the family table")


@pytest.fixture
def one_uncovered(monkeypatch):
    """The real locate_blocks, plus one uncovered block (the zoo models of `conserve run` have none)."""
    real = monitor_mod.locate_blocks

    def locate_blocks(model, **kw):
        found = real(model, **kw)
        if kw.get("warn", True):
            warnings.warn(f"flowgeom: block {FAKE.block} is not covered by any law ({FAKE.reason}); it is not "
                          "measured", FlowgeomWarning, stacklevel=2)
        return Located(found.entry, found.uncovered + (FAKE,))

    monkeypatch.setattr(monitor_mod, "locate_blocks", locate_blocks)


def test_conserve_run_lists_uncovered_in_json_and_warns_once(one_uncovered, tmp_path, capsys):
    rc = main(["conserve", "run", "--arch", "mha-rope-swiglu", "--steps", "2", "--seeds", "2", "--regime", "gd",
               "--lr", "0.05", "--json", "--out", str(tmp_path / "runs")])
    out, err = capsys.readouterr()
    assert rc == 0, err
    payload = json.loads(out)
    assert payload["uncovered"] == [FAKE.as_dict()]
    assert [r["uncovered"] for r in payload["runs"]] == [[FAKE.as_dict()]] * 2  # each run's summary keeps it
    lines = [line for line in err.splitlines() if "mystery" in line]
    assert len(lines) == 1 and lines[0].startswith("flowgeom: warning: not covered by any law")
    assert "Traceback" not in err


def test_conserve_run_without_uncovered_blocks_says_so(tmp_path, capsys):
    rc = main(["conserve", "run", "--arch", "mha-rope-swiglu", "--steps", "2", "--seeds", "1", "--regime", "gd",
               "--lr", "0.05", "--json", "--out", str(tmp_path / "runs")])
    out, err = capsys.readouterr()
    assert rc == 0, err
    payload = json.loads(out)
    assert payload["uncovered"] == [] and payload["runs"][0]["uncovered"] == []
    assert "not covered" not in err
