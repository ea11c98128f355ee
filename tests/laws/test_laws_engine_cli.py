"""`flowgeom laws count|discover`: JSON contract, human output, exit code 2 on bad input."""

import argparse
import json
import textwrap

import pytest

from flowgeom.cli import main
from flowgeom.cli.laws_engine import register_verbs


def _run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_count_json_contract(capsys):
    code, out, _ = _run(capsys, "laws", "count", "relu2", "--d-in", "3", "--width", "2", "--d-out", "2", "--bias", "--json")
    assert code == 0
    data = json.loads(out)
    assert {"parameters", "rank", "laws", "ranks_by_depth", "expected", "seconds", "seed", "gap"} <= set(data)
    assert (data["parameters"], data["laws"], data["expected"]) == (14, 2, 2)
    assert data["gap"]["tolerance"] == 1e-9 and data["gap"]["ratio"] > 1e6


def test_count_human_table_reports_the_sigmoid_finding(capsys):
    code, out, _ = _run(capsys, "laws", "count", "moe", "--gate", "sigmoid", "--d-model", "2", "--d-hidden", "1", "--experts", "2")
    assert code == 0
    assert "2 independent conservation laws" in out and "matches the catalogue's 2" in out
    assert "tolerance 1e-09" in out and "rank of Lie(W)(θ) by bracket depth" in out


def test_count_file_target_and_float32(capsys, tmp_path):
    path = tmp_path / "blk.py"
    path.write_text(textwrap.dedent("""
        from torch import nn
        def build():
            return nn.Sequential(nn.Linear(8, 4, bias=False), nn.ReLU(), nn.Linear(4, 2, bias=False))
    """))
    code, out, _ = _run(capsys, "laws", "count", f"{path}:build", "--input-shape", "8", "--dtype", "float32", "--json")
    data = json.loads(out)
    assert code == 0 and data["laws"] == 4 and data["expected"] is None and data["dtype"] == "float32"


def test_discover_json_and_text(capsys):
    code, out, _ = _run(capsys, "laws", "discover", "swiglu", "--d-model", "2", "--d-hidden", "2", "--json")
    data = json.loads(out)
    assert code == 0 and data["count"] == data["expected"] == 2
    assert data["laws"][0] == "‖up_proj.weight[0,:]‖² − ‖down_proj.weight[:,0]‖²"
    code, out, _ = _run(capsys, "laws", "discover", "ffn", "--d-model", "2", "--d-hidden", "2")
    assert code == 0 and "only constant functions" in out


@pytest.mark.parametrize("argv,match", [
    (["laws", "count", "no_such_pkg_q:Thing"], "could not import module"),
    (["laws", "count", "torch.nn:ReLU", "--input-shape", "3"], "no parameters"),
    (["laws", "count", "torch.nn:Identity", "--input-shape", "3"], "no parameters"),
    (["laws", "count", "ffn", "--input-shape", "3"], None),
    (["laws", "count", "swiglu", "--heads", "2"], "--heads does not apply to swiglu"),
    (["laws", "count", "mha", "--device", "tpu"], "unknown --device"),
    (["laws", "discover", "swiglu", "--max-parameters", "10"], "pass --max-parameters 144"),
])
def test_bad_input_is_one_line_exit_2(capsys, argv, match):
    code, _, err = _run(capsys, *argv)
    if match is None:  # --input-shape is ignored when the module draws its own input
        assert code == 0
        return
    assert code == 2 and err.startswith("flowgeom: error:") and match in err and err.count("\n") == 1


def test_rejected_input_shape(capsys, tmp_path):
    path = tmp_path / "lin.py"
    path.write_text("from torch import nn\ndef make():\n    return nn.Linear(3, 2)\n")
    code, _, err = _run(capsys, "laws", "count", f"{path}:make", "--input-shape", "5")
    assert code == 2 and "rejected an input of shape (5,)" in err


def test_cli_input_errors_name_the_flag(capsys, tmp_path):
    # the engine's own wording is input_shape=...; on the command line the fix is the flag
    path = tmp_path / "lin.py"
    path.write_text("from torch import nn\ndef make():\n    return nn.Linear(3, 2)\n")
    for verb in ("count", "discover"):
        code, _, err = _run(capsys, "laws", verb, f"{path}:make", "--input-shape", "5")
        assert code == 2 and "an --input-shape it accepts" in err and "input_shape" not in err


def test_register_verbs_on_a_fresh_parser():
    parser = argparse.ArgumentParser()
    register_verbs(parser.add_subparsers(dest="verb"))
    args = parser.parse_args(["count", "mha", "--heads", "3", "--positions", "rope", "--d-k", "4"])
    assert args.target == "mha" and args.zoo_heads == 3 and args.zoo_positions == "rope" and args.dtype == "float64"
    assert not hasattr(parser.parse_args(["discover", "ffn"]), "zoo_heads")  # only flags the user set


def test_demo_table_rows_agree_and_mark_the_sigmoid_finding(capsys):
    from flowgeom.cli.laws_engine import print_count_table
    from flowgeom.laws.describe import count_rows

    rows = count_rows()
    assert rows and all(r["match"] for r in rows)
    sig = [r for r in rows if r["finding"]]
    assert len(sig) == 2 and all(r["numeric"] == 9 for r in sig)  # E·m = 3·3; the seed's +d is refuted
    print_count_table(rows)
    assert "refuted" in capsys.readouterr().out


def test_discover_latex_and_groups(capsys):
    code, out, _ = _run(capsys, "laws", "discover", "swiglu", "--d-model", "2", "--d-hidden", "2", "--latex")
    assert code == 0 and out.startswith("\\begin{align*}") and out.rstrip().endswith("\\end{align*}")
    assert r"h_{1} &= \lVert \mathtt{up\_proj.weight}[0,:] \rVert^2 - \lVert \mathtt{down\_proj.weight}[:,0] \rVert^2 \\" in out
    code, out, _ = _run(capsys, "laws", "discover", "swiglu", "--d-model", "2", "--d-hidden", "2")
    assert "reads up_proj.weight, down_proj.weight: 2 laws" in out


def test_progress_bar_only_on_a_terminal_and_after_a_delay(monkeypatch, capsys):
    import sys

    from flowgeom.cli.laws_engine import engine_progress

    with engine_progress(True) as update:  # pytest captures stderr: not a terminal, no bar
        assert update is None
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    with engine_progress(False) as update:  # --json: never a bar
        assert update is None
    with engine_progress(True, after=3600) as update:  # a count shorter than `after` never draws one
        update("rank of Lie(W), depth 0", 5, 10)
    assert capsys.readouterr().err == ""
    with engine_progress(True, after=0) as update:  # past the delay: the bar starts and follows the stage
        update("rank of Lie(W), depth 0", 5, 10)
        update("rank of Lie(W), depth 1", 8, 10)
    assert "rank of Lie(W), depth" in capsys.readouterr().err
