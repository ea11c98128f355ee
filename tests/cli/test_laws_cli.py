import json

import pytest

from flowgeom.cli import main


def test_laws_show_json(capsys):
    assert main(["laws", "show", "mha", "--heads", "2", "--d-k", "4", "--positions", "rope", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["arch"] == "mha" and out["count"] == 2 * (2 + 6)
    assert {"arch", "parameters", "laws", "count", "check"} <= set(out)
    assert out["check"]["passed"] and out["check"]["max_violation"] < 1e-10
    assert all({"name", "formula", "count"} <= set(law) for law in out["laws"])
    assert out["controls"][0]["violation"] > 1e-4


def test_laws_show_sigmoid_reports_refuted_claim(capsys):
    assert main(["laws", "show", "moe", "--gate", "sigmoid"]) == 0
    text = capsys.readouterr().out
    assert "refuted claim" in text and "up_proj.weight[i,:]" in text


def test_laws_list_json_covers_the_zoo(capsys):
    assert main(["laws", "list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["arch"] for r in rows} == {"ffn", "swiglu", "mha", "moe", "linear2", "relu2", "chain"}
    assert all(r["passed"] for r in rows)
    assert sum(bool(r["refuted"]) for r in rows) == 2


@pytest.mark.parametrize("argv,fragment", [
    (["laws", "show", "transformer"], "unknown architecture"),
    (["laws", "show", "mha", "--positions", "rope", "--d-k", "3"], "even"),
    (["laws", "show", "moe", "--top-k", "9"], "top-k"),
    (["laws", "show", "swiglu", "--d-hidden", "-2"], "--d-hidden must be a whole number >= 1, got -2"),
    (["laws", "show", "swiglu", "--experts", "2"], "does not apply"),
])
def test_bad_input_is_one_line_and_exit_2(argv, fragment, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1 and "Traceback" not in err


def test_argparse_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["laws", "show", "mha", "--positions", "alibi"])
    assert exc.value.code == 2


def test_every_command_help_has_an_example(capsys):
    from flowgeom.cli import build_parser

    parser = build_parser()
    areas = parser._subparsers._group_actions[0].choices
    for name, area_parser in areas.items():
        verbs = [a for a in area_parser._actions if hasattr(a, "choices") and isinstance(a.choices, dict)]
        commands = verbs[0].choices.values() if verbs else [area_parser]
        for cmd in commands:
            if cmd.get_default("func") is None:
                continue
            assert "example:" in cmd.format_help(), f"{cmd.prog} --help lacks an example"
