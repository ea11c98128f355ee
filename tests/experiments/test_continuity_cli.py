"""`continuity train|ablate|plot` verbs through a fresh argparse parser."""

import json

import pytest

from flowgeom.cli.continuity_train import build_parser
from flowgeom.errors import FlowgeomError


def run(argv):
    args = build_parser().parse_args(argv)
    return args.func(args)


def test_train_mlp_json_and_resume(tmp_path, capsys):
    out = tmp_path / "mlp"
    argv = ["train", "mlp", "--variant", "Res+Radial", "--steps", "2", "--log-every", "1", "--out", str(out), "--json",
            "--set", "width=8", "--set", "depth=3", "--set", "train_limit=64", "--set", "test_limit=32"]
    assert run(argv) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["summary"]["status"] == "finished" and payload["row"]["variant"] == "Res+Radial"
    config = json.loads((out / "config.json").read_text())
    assert config["activation"] == "radial" and config["width"] == 8 and config["train_limit"] == 64
    with pytest.raises(FlowgeomError, match="--resume"):
        run(argv)
    assert run(argv + ["--resume"]) == 0
    assert run(["plot", str(out), "--figure", str(tmp_path / "f.png")]) == 0
    assert (tmp_path / "f.png").stat().st_size > 1000


def test_train_lm_table(tmp_path, capsys):
    out = tmp_path / "lm"
    text_file = tmp_path / "corpus.txt"
    text_file.write_text("And God said, Let there be light: and there was light. " * 20)
    tiny = ["--set", "n_layers=2", "--set", "d_model=16", "--set", "heads=2", "--set", "d_k=8", "--set", "d_hidden=16",
            "--set", "seq_len=16", "--set", "batch=2"]
    assert run(["train", "lm", "--mlp", "gelu", "--steps", "2", "--log-every", "1", "--out", str(out),
                "--data", str(text_file), *tiny]) == 0
    text = capsys.readouterr().out
    assert "role" in text and "down" in text and "gate" not in text


def test_bad_input_is_a_flowgeom_error(tmp_path):
    with pytest.raises(FlowgeomError, match="unknown variant"):
        run(["train", "mlp", "--variant", "Res+Tanh", "--out", str(tmp_path / "x")])
    with pytest.raises(FlowgeomError, match="unknown variant"):
        run(["ablate", "--variants", "NoRes,Bogus", "--out", str(tmp_path / "y")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(FlowgeomError, match="no continuity records"):
        run(["plot", str(tmp_path / "empty")])
    with pytest.raises(FlowgeomError, match="KEY=VALUE"):
        run(["train", "mlp", "--set", "width", "--out", str(tmp_path / "w")])
    with pytest.raises(FlowgeomError, match="unknown MLP run option"):
        run(["train", "mlp", "--set", "widht=3", "--out", str(tmp_path / "w")])
    with pytest.raises(SystemExit):
        run(["train", "cnn", "--out", str(tmp_path / "z")])


def test_every_verb_has_an_example():
    parser = build_parser()
    text = parser._subparsers._group_actions[0].choices
    for verb in ("train", "ablate", "plot"):
        assert "example:" in text[verb].format_help()
