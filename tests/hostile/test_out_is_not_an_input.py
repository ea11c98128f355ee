"""An output path that is, or lies inside, an input is refused before any work (``continuity analyze``).

``analyze X.safetensors --out X.safetensors`` used to replace the weights with
the JSON report; ``--figure`` likewise. Symlinks are resolved, so a link to the
input is the input. Every case: one line, exit 2, every file byte-identical.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from flowgeom.errors import FlowgeomError
from flowgeom.runs import check_out_file
from tree_digest import snapshot  # noqa: E402  (tests/hostile is on sys.path)


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {f"model.layers.{i}.mlp.{r}_proj.weight": torch.randn(8, 8, generator=gen)
            for i in range(3) for r in ("up", "down", "gate")}


@pytest.fixture
def model(tmp_path) -> Path:
    folder = tmp_path / "m"
    folder.mkdir()
    save_file(_state(), folder / "model.safetensors")
    return folder


@pytest.mark.parametrize("source, flag, out, line", [
    ("m/model.safetensors", "--out", "m/model.safetensors",
     "--out m/model.safetensors is the input m/model.safetensors: writing it would replace what is being read; "
     "choose another --out"),
    ("link.safetensors", "--out", "m/model.safetensors",
     "--out m/model.safetensors is the input link.safetensors: writing it would replace what is being read; "
     "choose another --out"),
    ("m/model.safetensors", "--out", "link.safetensors",
     "--out link.safetensors is the input m/model.safetensors: writing it would replace what is being read; "
     "choose another --out"),
])
def test_an_output_onto_the_input_file_is_refused(model, tmp_path, cli, monkeypatch, source, flag, out, line):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "link.safetensors").symlink_to(model / "model.safetensors")
    before = snapshot(tmp_path)
    rc, stdout, err = cli(["continuity", "analyze", source, flag, out])
    assert rc == 2 and not stdout and err.strip() == f"flowgeom: error: {line}"
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("flag, out", [("--out", "m/model.safetensors"), ("--figure", "m/heatmap.png")])
def test_an_output_inside_the_input_folder_is_refused(model, tmp_path, cli, monkeypatch, flag, out):
    monkeypatch.chdir(tmp_path)
    before = snapshot(tmp_path)
    rc, _, err = cli(["continuity", "analyze", "m", flag, out])
    real = os.path.realpath(model)
    assert rc == 2 and err.strip() == (f"flowgeom: error: {flag} {out} lies inside the input folder {real}: writing "
                                       f"there could replace what is being read; choose another {flag} outside it")
    assert snapshot(tmp_path) == before  # the weights are byte-identical
    assert out == "m/model.safetensors" or not (tmp_path / out).exists()


def test_an_output_next_to_the_input_is_written(model, tmp_path, cli, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = snapshot(tmp_path / "m")
    rc, _, _ = cli(["continuity", "analyze", "m/model.safetensors", "--out", "report.json", "--k", "2"])
    assert rc == 0 and (tmp_path / "report.json").is_file() and snapshot(tmp_path / "m") == before


def test_sharded_index_folder_is_an_input(tmp_path):
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(FlowgeomError, match="lies inside the input folder"):
        check_out_file(tmp_path / "s" / "model-00001-of-00002.safetensors",
                       inputs=[tmp_path / "s" / "model.safetensors.index.json"])
    check_out_file(tmp_path / "elsewhere.json", inputs=[tmp_path / "s" / "model.safetensors.index.json",
                                                        "builtin:smollm2"])


@pytest.mark.parametrize("argv", [["compress", "evaluate", "other.safetensors", "--out", "m/model.safetensors"],
                                  ["continuity", "analyze", "other.safetensors", "--out", "m/model.safetensors"]])
def test_a_report_never_replaces_an_existing_checkpoint(model, tmp_path, cli, monkeypatch, argv):
    """Whatever the inputs: ``--out`` onto a file that starts like safetensors/GGUF is refused (evaluate included)."""
    monkeypatch.chdir(tmp_path)
    save_file(_state(), tmp_path / "other.safetensors")
    before = snapshot(tmp_path)
    rc, _, err = cli(argv)
    assert rc == 2 and err.strip() == ("flowgeom: error: --out m/model.safetensors is an existing model checkpoint; "
                                       "--out writes a report and would replace the weights: choose another --out")
    assert snapshot(tmp_path) == before


def test_a_gguf_is_recognised_and_a_report_may_be_replaced(tmp_path):
    (tmp_path / "w.gguf").write_bytes(b"GGUF" + bytes(20))
    with pytest.raises(FlowgeomError, match="is an existing model checkpoint"):
        check_out_file(tmp_path / "w.gguf")
    (tmp_path / "report.json").write_text('{"old": 1}\n')
    check_out_file(tmp_path / "report.json")  # an old report is meant to be replaced
    check_out_file(tmp_path / "w.gguf", "the output")  # internal writers (checkpoint savers) are not reports


def test_evaluate_out_inside_the_model_folder_it_reads_is_refused(model, tmp_path, cli, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = snapshot(tmp_path)
    rc, _, err = cli(["compress", "evaluate", "m", "--out", "m/report.json"])
    assert rc == 2 and "lies inside the input folder" in err and len(err.strip().splitlines()) == 1
    assert snapshot(tmp_path) == before
