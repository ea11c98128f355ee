"""One output helper (``runs.atomic_write`` / ``open_append``): no write follows a planted symlink, none lands in an input.

Every case plants a real symlink (at the output file, or as a sub-folder of
the folder being written) pointing at a sentinel folder outside, and checks
the exact one-line refusal and that the sentinel is byte-identical (sha256).
The CLI cases also check exit code 2. A link swapped in *during* a write is
not followed either: the helper walks the folders by descriptor.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from flowgeom.errors import FlowgeomError
from flowgeom.runs import RunFolder, atomic_write, atomic_write_bytes, atomic_write_json, open_append
from tree_digest import snapshot  # noqa: E402  (tests/hostile is on sys.path)

LINK = "flowgeom never writes through a link out of"
TRAIN = ["continuity", "train", "mlp", "--variant", "Res+None", "--steps", "4", "--log-every", "1",
         "--set", "width=8", "--set", "depth=3", "--set", "train_limit=64", "--set", "test_limit=32",
         "--set", "ckpt_every=2"]


@pytest.fixture
def outside(tmp_path) -> Path:
    """A folder that is not the output: its content must never change."""
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "precious.json").write_text('{"mine": true}\n')
    return folder


def test_a_link_at_the_output_file_is_refused(tmp_path, outside):
    root = tmp_path / "out"
    root.mkdir()
    (root / "report.json").symlink_to(outside / "precious.json")
    before = snapshot(outside)
    with pytest.raises(FlowgeomError) as info:
        atomic_write_json(root / "report.json", {"x": 1}, root=root)
    assert str(info.value) == (f"the output {root / 'report.json'} goes through the symlink {root / 'report.json'} "
                               f"(-> {outside / 'precious.json'}); {LINK} {root}: remove the link")
    assert snapshot(outside) == before and (root / "report.json").is_symlink()
    assert sorted(p.name for p in root.iterdir()) == ["report.json"]  # no temporary file left behind


@pytest.mark.parametrize("depth", [1, 2])
def test_a_linked_subfolder_of_the_output_is_refused(tmp_path, outside, depth):
    root = tmp_path / "out"
    (root / "a").mkdir(parents=True)
    link = root / "a" / "figures" if depth == 2 else root / "figures"
    link.symlink_to(outside)
    target = link / "sub" / "f.png"
    before = snapshot(outside)
    with pytest.raises(FlowgeomError) as info:
        atomic_write_bytes(target, b"png", root=root)
    assert str(info.value) == f"the output {target} goes through the symlink {link} (-> {outside}); {LINK} {root}: " \
                              "remove the link"
    assert snapshot(outside) == before and sorted(p.name for p in outside.iterdir()) == ["precious.json"]


def test_a_link_swapped_in_during_the_write_is_not_followed(tmp_path, outside):
    """The folder was opened by descriptor before the write: replacing it by a link meanwhile changes nothing."""
    root = tmp_path / "out"
    (root / "sub").mkdir(parents=True)

    def write(fh):
        (root / "sub").rename(root / "moved")
        (root / "sub").symlink_to(outside)  # what an attacker racing the writer would do
        fh.write(b"result")

    atomic_write(root / "sub" / "r.bin", write, root=root)
    assert (root / "moved" / "r.bin").read_bytes() == b"result"
    assert sorted(p.name for p in outside.iterdir()) == ["precious.json"]


def test_the_users_own_root_may_be_a_link(tmp_path, outside):
    (tmp_path / "mine").symlink_to(outside)
    atomic_write_bytes(tmp_path / "mine" / "new.txt", b"ok\n", root=tmp_path / "mine")
    assert (outside / "new.txt").read_bytes() == b"ok\n"


def test_an_output_inside_an_input_is_refused_when_written(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    save_file({"w": torch.zeros(2)}, model / "model.safetensors")
    before = snapshot(tmp_path)
    with pytest.raises(FlowgeomError, match=f"lies inside the input folder {os.path.realpath(model)}"):
        atomic_write_json(model / "report.json", {}, inputs=[model])
    with pytest.raises(FlowgeomError, match="is the input"):
        atomic_write_json(model / "model.safetensors", {}, inputs=[model / "model.safetensors"])
    assert snapshot(tmp_path) == before


def test_a_run_folders_figures_link_is_refused(tmp_path, outside):
    run = RunFolder(tmp_path / "r")
    run.start({"a": 1}, resume=False)
    (run.path / "figures").symlink_to(outside)
    with pytest.raises(FlowgeomError) as info:
        run.figures
    assert str(info.value) == (f"figures folder {run.path / 'figures'} goes through the symlink {run.path / 'figures'} "
                               f"(-> {outside}); {LINK} {run.path}: remove the link")


def test_appending_through_a_link_is_refused(tmp_path, outside):
    run = RunFolder(tmp_path / "r")
    run.start({"a": 1}, resume=False)
    (run.path / "metrics.jsonl").symlink_to(outside / "precious.json")
    before = snapshot(outside)
    with pytest.raises(FlowgeomError, match=f"goes through the symlink {run.path / 'metrics.jsonl'} "):
        run.log({"step": 0})
    assert snapshot(outside) == before


@pytest.mark.skipif(not hasattr(signal, "SIGALRM") or not hasattr(os, "mkfifo"), reason="needs FIFOs and SIGALRM")
def test_appending_to_a_fifo_is_refused_without_blocking(tmp_path):
    """An alarm guards the call: a regression (an open that blocks on the FIFO) fails instead of hanging."""
    os.mkfifo(tmp_path / "metrics.jsonl")

    def hang(*_):
        raise TimeoutError("open_append blocked on a FIFO")

    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(10)
    try:
        with pytest.raises(FlowgeomError) as info:
            open_append(tmp_path / "metrics.jsonl")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert str(info.value) == (f"{tmp_path / 'metrics.jsonl'} is a FIFO (named pipe), not a regular file; "
                               "remove it and run again")


def test_append_creates_and_appends(tmp_path):
    for line in ("a\n", "b\n"):
        with open_append(tmp_path / "new" / "log.txt", root=tmp_path) as fh:
            fh.write(line)
    assert (tmp_path / "new" / "log.txt").read_text() == "a\nb\n"


# -- the CLI: one line, exit 2, nothing outside --out changed ---------------------------------------------

def test_cli_out_onto_a_planted_link_is_one_line_exit_2(tmp_path, outside, cli, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m").mkdir()
    gen = torch.Generator().manual_seed(0)
    save_file({f"model.layers.{i}.mlp.up_proj.weight": torch.randn(8, 8, generator=gen) for i in range(3)},
              tmp_path / "m" / "model.safetensors")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "report.json").symlink_to(outside / "precious.json")
    before = snapshot(tmp_path)
    rc, stdout, err = cli(["continuity", "analyze", "m", "--out", "out/report.json"])
    assert rc == 2 and not stdout
    assert err.strip() == (f"flowgeom: error: --out out/report.json goes through the symlink out/report.json "
                           f"(-> {outside / 'precious.json'}); {LINK} out: remove the link")
    assert snapshot(tmp_path) == before


def test_cli_resume_into_a_run_with_a_planted_metrics_link(tmp_path, outside, cli, monkeypatch):
    """An unfinished run folder from someone else: its metrics.jsonl links outside; --resume refuses to write it."""
    monkeypatch.chdir(tmp_path)
    rc, _, _ = cli(TRAIN + ["--out", "r"])
    assert rc == 0
    (tmp_path / "r" / "summary.json").unlink()  # "killed before the end"
    (outside / "precious.jsonl").write_bytes((tmp_path / "r" / "metrics.jsonl").read_bytes())
    (tmp_path / "r" / "metrics.jsonl").unlink()
    (tmp_path / "r" / "metrics.jsonl").symlink_to(outside / "precious.jsonl")
    before = snapshot(outside)
    rc, _, err = cli(TRAIN + ["--out", "r", "--resume"])
    assert rc == 2 and err.strip() == (f"flowgeom: error: the output r/metrics.jsonl goes through the symlink "
                                       f"r/metrics.jsonl (-> {outside / 'precious.jsonl'}); {LINK} r: remove the link")
    assert snapshot(outside) == before
    assert not (tmp_path / "r" / "summary.json").exists()  # never presented as finished


def test_cli_a_linked_subfolder_of_out_is_refused_before_training(tmp_path, outside, cli, monkeypatch):
    """``conserve run --out OUT`` writes OUT/REGIME/ARCH/...: a planted OUT/gd link is refused, nothing trained."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "gd").symlink_to(outside)
    before = snapshot(outside)
    rc, _, err = cli(["conserve", "run", "--task", "lm", "--arch", "mha-none-swiglu", "--regime", "gd", "--lr", "0.1",
                      "--seeds", "1", "--steps", "1", "--out", "out"])
    assert rc == 2 and err.strip() == (
        f"flowgeom: error: run folder out/gd goes through the symlink out/gd (-> {outside}); {LINK} out: remove the link")
    assert snapshot(outside) == before and sorted(p.name for p in outside.iterdir()) == ["precious.json"]


def test_cli_a_linked_figure_is_refused_before_the_work(tmp_path, outside, cli, monkeypatch):
    """--figure onto a planted link: refused by the argument check, before the probe runs, nothing written."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "fig.png").symlink_to(outside / "precious.png")
    before = snapshot(outside)
    rc, stdout, err = cli(["langevin", "villani", "--figure", "fig.png"])
    assert rc == 2 and not stdout
    assert err.strip() == ("flowgeom langevin villani: error: argument --figure: --figure fig.png goes through the "
                           f"symlink fig.png (-> {outside / 'precious.png'}); {LINK} .: remove the link; "
                           "see `flowgeom langevin villani --help`")
    assert snapshot(outside) == before
