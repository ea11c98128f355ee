"""`flowgeom continuity analyze --gram exact|sketch|auto --probes N --rel-error E --seed S` (issue 41).

Bad input: one line on stderr, exit 2, nothing written. A sketched run shows its intervals in the table and
the JSON, says which roles were sketched and why, and flags a ratio interval that straddles the threshold.
"""

from __future__ import annotations

import json

import pytest
from safetensors.torch import save_file
from synthetic_checkpoints import llama_state

from flowgeom.cli import main
from flowgeom.continuity import AnalyzeConfig
from flowgeom.errors import FlowgeomError


def _code(argv: list[str]) -> int:
    """``main``'s exit code; argparse's usage errors exit through SystemExit (one line, 2)."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "m.safetensors"
    save_file(llama_state(layers=4, d=48, kv=24, hidden=64, seed=3), path)  # narrowest side: k, v (24)
    return path


@pytest.mark.parametrize("flags,msg", [
    (["--probes", "0"], "--probes: must be a whole number >= 1, got 0"),
    (["--probes", "-3"], "--probes: must be a whole number >= 1"),
    (["--probes", "2.5"], "--probes: expected a whole number"),
    (["--gram", "sketch", "--probes", "25"], "--probes 25 is beyond the side 24 of role k"),
    (["--rel-error", "0"], "--rel-error must be between 0 and 1"),
    (["--rel-error", "1"], "--rel-error must be between 0 and 1"),
    (["--rel-error", "-0.1"], "--rel-error must be between 0 and 1"),
    (["--rel-error", "1.5"], "--rel-error must be between 0 and 1"),
    (["--rel-error", "nan"], "--rel-error is nan"),
    (["--rel-error", "two"], "--rel-error: invalid float value"),
    (["--gram", "sketch", "--no-gram"], "--gram sketch asks for the sigma^2-Gram similarity and --no-gram skips it"),
    (["--seed", "1.5"], "--seed: expected a whole number, got '1.5'"),
    (["--seed", "x"], "--seed: expected a whole number"),
    (["--probes", "8", "--rel-error", "0.05"], "give one of them"),
    (["--gram", "fast"], "--gram: invalid choice: 'fast'"),
])
def test_bad_input_is_one_line_and_exit_2(checkpoint, tmp_path, capsys, flags, msg):
    out = tmp_path / "r.json"
    code = _code(["continuity", "analyze", str(checkpoint), "--out", str(out), *flags])
    err = capsys.readouterr().err
    assert code == 2 and msg in err and err.count("\n") == 1, err
    assert not out.exists()


def test_the_probe_count_is_checked_only_where_it_is_used(checkpoint, capsys):
    """--gram auto keeps this small checkpoint exact: a --probes beyond a side is then not an error."""
    assert main(["continuity", "analyze", str(checkpoint), "--json", "--probes", "25"]) == 0
    assert all(r["gram"]["method"] == "exact" for r in json.loads(capsys.readouterr().out)["roles"].values())


@pytest.mark.parametrize("bad,msg", [
    (dict(seed=1.5), "--seed must be a whole number in [0, 2**63), got float 1.5"),
    (dict(seed=-1), "--seed must be a whole number"),
    (dict(gram_method="fast"), "unknown gram_method 'fast'; choose one of: auto, exact, sketch"),
    (dict(probes=0), "--probes must be a whole number >= 1, got 0"),
    (dict(rel_error=float("inf")), "--rel-error is inf"),
])
def test_the_config_refuses_the_same_in_python(bad, msg):
    with pytest.raises(FlowgeomError, match=msg.replace("[", r"\[").replace("*", r"\*").replace("(", r"\(")
                       .replace(")", r"\)")):
        AnalyzeConfig(**bad)


def test_a_sketched_run_shows_its_intervals(checkpoint, capsys):
    assert main(["continuity", "analyze", str(checkpoint), "--gram", "sketch", "--probes", "16", "--seed", "4",
                 "--roles", "q,down"]) == 0
    table = capsys.readouterr().out
    assert "sigma^2-Gram similarity sketched (Hutch++" in table and "--probes 16" in table
    assert "q --gram sketch, 16/16 probes (in/out)" in " ".join(table.split())
    assert main(["continuity", "analyze", str(checkpoint), "--gram", "sketch", "--seed", "4", "--json",
                 "--roles", "q"]) == 0
    q = json.loads(capsys.readouterr().out)["roles"]["q"]
    assert q["gram"]["method"] == "sketch" and q["gram"]["rel_error"] == 0.02 and not q["gram"]["fixed_probes"]
    lo, hi = q["metrics"]["gram_in"]["ci"]
    assert lo <= q["metrics"]["gram_in"]["mean"] <= hi
    assert all(p["gram_in_ci"][0] <= p["gram_in"] <= p["gram_in_ci"][1] for p in q["pairs"])


def test_an_interval_across_the_threshold_is_said(checkpoint, capsys):
    """A threshold set inside gram_in's ratio interval: the table says the ratio is undecided."""
    assert main(["continuity", "analyze", str(checkpoint), "--gram", "sketch", "--probes", "8", "--json",
                 "--roles", "q"]) == 0
    ratio_ci = json.loads(capsys.readouterr().out)["roles"]["q"]["metrics"]["gram_in"]["ratio_ci"]
    threshold = max(sum(ratio_ci) / 2, 1.001)
    assert ratio_ci[0] < threshold <= ratio_ci[1]
    assert main(["continuity", "analyze", str(checkpoint), "--gram", "sketch", "--probes", "8", "--roles", "q",
                 "--threshold", str(threshold)]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "q gram_in: its 95% interval of the ratio to baseline" in text and "straddles the threshold" in text


def test_one_probe_has_no_interval_and_says_so(checkpoint, capsys):
    assert main(["continuity", "analyze", str(checkpoint), "--gram", "sketch", "--probes", "1", "--roles", "q"]) == 0
    captured = capsys.readouterr()
    assert "[no" in captured.out and "leaves one residual probe" in captured.err  # the cell wraps "[no interval]"
    assert main(["continuity", "analyze", str(checkpoint), "--gram", "sketch", "--probes", "1", "--roles", "q",
                 "--json"]) == 0
    q = json.loads(capsys.readouterr().out)["roles"]["q"]
    assert q["metrics"]["gram_in"]["ci"] is None and q["pairs"][0]["gram_in_ci"] is None
