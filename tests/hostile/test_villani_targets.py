"""``flowgeom langevin villani FILE.py:NAME`` with hostile user files: one line, exit 2, through the shared loader.

The loader is the one ``laws count FILE.py:NAME`` uses (:mod:`flowgeom.usercode`): a FIFO is refused unopened,
an import or factory that raises or calls ``sys.exit`` is named, and what the factory returns is checked.
"""

from __future__ import annotations

import os

import pytest

from test_fifo_inputs import FIFO, flowgeom  # noqa: E402  (tests/hostile is on sys.path)


def test_a_fifo_target_file_is_refused_unopened(tmp_path):
    os.mkfifo(tmp_path / "loss.py")
    rc, err = flowgeom(["langevin", "villani", "loss.py:make"], tmp_path, tmp_path / "cache")
    assert rc == 2 and err.splitlines() == [f"flowgeom: error: target file loss.py {FIFO}: give path/to/file.py:NAME"]


@pytest.mark.parametrize("body, line", [
    ("import sys\nsys.exit(3)\n",
     "could not import '{path}': it called sys.exit(3); the file must define the module without exiting or raising"),
    ("import sys\ndef make():\n    sys.exit(4)\n", "building {path}:make failed: it called sys.exit(4)"),
    ("def make():\n    return 'a loss'\n",
     "{path}:make returned a str; NAME must be a zero-argument factory returning (loss_fn, theta0) or a "
     "flowgeom.langevin.Objective"),
    ("make = 7\n", "{path}:make is a int, not a zero-argument factory; NAME must be a zero-argument factory "
                   "returning (loss_fn, theta0) or a flowgeom.langevin.Objective"),
    ("import torch\ndef make():\n    return (lambda x: x.sum(), {})\n",
     "{path}:make: theta0 must be a tensor or a non-empty dict name -> tensor, got dict; e.g. {{n: p for n, p in "
     "model.named_parameters() if p.requires_grad}}"),
    ("import torch\ndef make():\n    return (lambda x: x.sum(), torch.arange(3))\n",
     "{path}:make: theta0['theta'] must be a non-empty floating-point tensor, got torch.int64 tensor of 3 elements"),
    ("def other():\n    pass\n", "'{path}' has no attribute 'make'; candidates: other"),
])
def test_bad_user_files_are_one_line(tmp_path, cli, body, line):
    path = tmp_path / "loss.py"
    path.write_text(body)
    rc, out, err = cli(["langevin", "villani", f"{path}:make"])
    assert rc == 2 and out == "" and err.strip() == "flowgeom: error: " + line.format(path=path)
