"""Every file flowgeom reads is refused, unopened, when it is a FIFO (``open`` would block forever).

One helper (:func:`flowgeom.files.regular_file` / ``open_regular`` /
``read_regular``) guards config.json, adapter_config.json, tokenizer.json, a
run's config.json and metrics.jsonl, a sweep's manifest.json and CIFAR
batches. Each case is a real FIFO made by ``os.mkfifo`` and a real ``flowgeom``
process with a timeout, so a regression (an open that blocks) fails the test
instead of hanging the suite. The exact one-line message, exit code 2, and
that no file outside ``--out`` changed (and ``--out`` was not written) are
checked.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")

TRAIN = ["continuity", "train", "mlp", "--variant", "Res+None", "--steps", "4", "--log-every", "1",
         "--set", "width=8", "--set", "depth=3", "--set", "train_limit=64", "--set", "test_limit=32",
         "--set", "ckpt_every=2"]
FIFO = "is a FIFO (named pipe), not a regular file; it was not opened (reading a FIFO or device can block forever)"


def flowgeom(argv, cwd: Path, cache: Path) -> tuple[int, str]:
    """``python -m flowgeom ARGV`` in its own process; a hang (timeout) fails the test."""
    try:
        proc = subprocess.run([sys.executable, "-m", "flowgeom", *map(str, argv)], cwd=cwd, capture_output=True,
                              text=True, timeout=180,
                              env=os.environ | {"OMP_NUM_THREADS": "1", "FLOWGEOM_CACHE": str(cache)})
    except subprocess.TimeoutExpired:
        pytest.fail(f"`flowgeom {' '.join(map(str, argv))}` blocked on a FIFO (timeout): it must be refused unopened")
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr, proc.stderr
    return proc.returncode, proc.stderr


def snapshot(root: Path) -> dict[str, str]:
    """sha256 of every regular file under ``root`` (FIFOs listed by name: they must never be opened)."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.relative_to(root).parts[0] == "cache":  # the token cache: flowgeom's own, not an input or output
            continue
        if p.is_fifo():
            out[str(p.relative_to(root))] = "fifo"
        elif p.is_file():
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _hf_folder(folder: Path) -> Path:
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder.mkdir()
    gen = torch.Generator().manual_seed(0)
    save_file({"model.layers.0.mlp.up_proj.weight": torch.randn(8, 4, generator=gen),
               "model.layers.0.mlp.down_proj.weight": torch.randn(4, 8, generator=gen)}, folder / "model.safetensors")
    tok = Tokenizer(models.WordLevel({"and": 0, "the": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    return folder


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json"])
def test_fifo_in_a_model_folder_is_refused_by_evaluate(tmp_path, name):
    model = _hf_folder(tmp_path / "m")
    (model / name).unlink(missing_ok=True)
    os.mkfifo(model / name)
    before = snapshot(tmp_path)
    rc, err = flowgeom(["compress", "evaluate", "m", "--context", "8", "--out", "o.json"], tmp_path,
                       tmp_path / "cache")
    fix = {"config.json": "an HF Llama folder needs config.json next to its safetensors",
           "tokenizer.json": "copy the original model's tokenizer.json there"}[name]
    assert rc == 2 and err.splitlines() == [f"flowgeom: error: {name} m/{name} {FIFO}: {fix}"], err
    assert not (tmp_path / "o.json").exists()
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("name", ["config.json", "adapter_config.json"])
def test_fifo_next_to_a_checkpoint_is_refused_by_analyze(tmp_path, name):
    model = _hf_folder(tmp_path / "m")
    os.mkfifo(model / name)
    before = snapshot(tmp_path)
    rc, err = flowgeom(["continuity", "analyze", "m", "--out", "o.json"], tmp_path, tmp_path / "cache")
    assert rc == 2 and err.splitlines() == [f"flowgeom: error: {name} m/{name} {FIFO}: fix or remove it"], err
    assert not (tmp_path / "o.json").exists()
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("name", ["metrics.jsonl", "config.json"])
def test_fifo_in_a_run_folder_is_refused_on_resume(tmp_path, cli, name):
    rc, _, _ = cli(TRAIN + ["--out", tmp_path / "r"])
    assert rc == 0
    run = tmp_path / "r"
    (run / "summary.json").unlink()  # killed before the end
    (run / name).unlink()
    os.mkfifo(run / name)
    before = snapshot(tmp_path)
    rc, err = flowgeom(TRAIN + ["--out", "r", "--resume"], tmp_path, tmp_path / "cache")
    fix = {"metrics.jsonl": "the run in r must be redone: delete that folder and rerun",
           "config.json": "delete the run folder and run it again"}[name]
    assert rc == 2 and err.splitlines() == [f"flowgeom: error: {name} r/{name} {FIFO}: {fix}"], err
    assert snapshot(tmp_path) == before


def test_fifo_manifest_and_cifar_batch_are_refused_in_the_api(tmp_path):
    """The library calls themselves, in a child process with a timeout (they would block the suite)."""
    os.mkfifo(tmp_path / "manifest.json")
    (tmp_path / "c").mkdir()
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        os.mkfifo(tmp_path / "c" / name)
    (tmp_path / "zero").symlink_to("/dev/zero")
    script = (
        "import sys\nfrom pathlib import Path\nfrom flowgeom.errors import FlowgeomError\n"
        "from flowgeom.reproduce.sweep import Manifest\nfrom flowgeom.data.images import load_cifar10\n"
        "from flowgeom.files import read_json_object\nroot = Path(sys.argv[1])\n"
        "for call in (lambda: Manifest(root), lambda: load_cifar10(root / 'c'),\n"
        "             lambda: read_json_object(root / 'zero', fix='pass a JSON file')):\n"
        "    try:\n        call()\n        print('READ')\n"
        "    except FlowgeomError as exc:\n        print(exc)\n")
    try:
        proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True,
                              timeout=120, env=os.environ | {"OMP_NUM_THREADS": "1"})
    except subprocess.TimeoutExpired:
        pytest.fail("a FIFO manifest.json or CIFAR batch blocked (timeout): it must be refused unopened")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        f"manifest.json {tmp_path / 'manifest.json'} {FIFO}: remove {tmp_path / 'manifest.json'}; the sweep reruns "
        "what it cannot verify",
        f"CIFAR-10 batch {tmp_path / 'c' / 'data_batch_1'} {FIFO}: "
        "pass the official CIFAR-10 python batches",
        f"zero {tmp_path / 'zero'} is a character device, not a regular file; it was not opened (reading a FIFO or "
        "device can block forever): pass a JSON file",
    ]


def test_a_fifo_target_file_is_refused_by_laws_count(tmp_path):
    """``laws count FILE.py:NAME`` with FILE.py a FIFO: refused by name, not imported (the import would block)."""
    os.mkfifo(tmp_path / "model.py")
    rc, err = flowgeom(["laws", "count", "model.py:Net"], tmp_path, tmp_path / "cache")
    assert rc == 2 and err.splitlines() == [f"flowgeom: error: target file model.py {FIFO}: give "
                                            "path/to/file.py:NAME"], err
