"""PEFT adapters whose values break ``continuity analyze --merge-lora`` (issue 35 §4): one line, exit 2.

``"lora_alpha": null`` was an internal ``TypeError`` (float(None)); ``1e308``
overflowed the merged weight (``OverflowError`` / a LAPACK failure in the
spectra); a 1-D ``lora_A`` was ``ValueError: not enough values to unpack``.
Each is now refused by name before anything is written, and a well-formed
adapter still merges.
"""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from flowgeom.continuity.layouts import MAX_LORA_SCALE
from test_file_numbers import _lora_folder  # noqa: E402  (tests/hostile is on sys.path)
from tree_digest import snapshot  # noqa: E402

Q = "model.layers.0.self_attn.q_proj"


def _analyze(cli, tmp_path, path):
    before = snapshot(tmp_path, skip=("cache",))
    rc, _, err = cli(["continuity", "analyze", path, "--merge-lora", "--out", tmp_path / "o.json"])
    assert not (tmp_path / "o.json").exists() and snapshot(tmp_path, skip=("cache",)) == before
    return rc, err.strip()


@pytest.mark.parametrize("adapter, line", [
    ({"lora_alpha": None, "r": 2}, f"adapter_config.json lora_alpha of {Q} must be a number, got None; fix it"),
    ({"lora_alpha": 1e308, "r": 2},
     f"adapter_config.json lora_alpha = 1e+308 gives {Q} the LoRA scale s = 5e+307 (lora_alpha / r), beyond "
     "±65536: W + s·B·A would overflow (no real adapter is scaled so); fix lora_alpha"),
    ({"lora_alpha": 4, "r": 2, "alpha_pattern": {"q_proj": 1e308}},
     f"adapter_config.json lora_alpha = 1e+308 gives {Q} the LoRA scale s = 5e+307 (lora_alpha / r), beyond "
     "±65536: W + s·B·A would overflow (no real adapter is scaled so); fix lora_alpha"),
    ({"lora_alpha": 4e5, "r": 2, "use_rslora": True},
     f"adapter_config.json lora_alpha = 400000 gives {Q} the LoRA scale s = 2.83e+05 (lora_alpha / sqrt(r)), beyond "
     "±65536: W + s·B·A would overflow (no real adapter is scaled so); fix lora_alpha"),
])
def test_forged_alpha_is_refused_by_name(tmp_path, cli, adapter, line):
    rc, err = _analyze(cli, tmp_path, _lora_folder(tmp_path / "m", 2, adapter))
    assert rc == 2 and err == f"flowgeom: error: {line}"


def test_one_dimensional_lora_a_is_refused_by_name(tmp_path, cli):
    path = _lora_folder(tmp_path / "m", 2, {"lora_alpha": 4, "r": 2})
    state = load_file(path / "model.safetensors")
    state[f"base_model.model.{Q}.lora_A.weight"] = torch.randn(16)
    save_file(state, path / "model.safetensors")
    rc, err = _analyze(cli, tmp_path, path)
    assert rc == 2 and err == (f"flowgeom: error: LoRA {Q}: A [16] and B [8, 2] must both be matrices, A (r, 8) and "
                               "B (8, r); the adapter file is damaged: use the adapter_model.safetensors PEFT saved")


def test_factors_that_overflow_the_merge_are_refused_by_name(tmp_path, cli):
    path = _lora_folder(tmp_path / "m", 2, {"lora_alpha": 4, "r": 2})
    state = load_file(path / "model.safetensors")
    state[f"base_model.model.{Q}.lora_B.weight"] = torch.full((8, 2), 1e300, dtype=torch.float64)
    state[f"base_model.model.{Q}.lora_A.weight"] = torch.full((2, 8), 3e38, dtype=torch.float32)
    save_file(state, path / "model.safetensors")
    rc, err = _analyze(cli, tmp_path, path)
    assert rc == 2 and err.startswith(f"flowgeom: error: --merge-lora: s·B·A of base_model.model.{Q}.base_layer.weight "
                                      "is not finite in float64 (LoRA scale s = 2, or inf/NaN in ")


def test_the_largest_accepted_scale_still_merges(tmp_path, cli, strict_json):
    alpha = 2 * MAX_LORA_SCALE  # s = alpha / r = the limit itself
    path = _lora_folder(tmp_path / "m", 2, {"lora_alpha": alpha, "r": 2})
    rc, out, _ = cli(["continuity", "analyze", path, "--merge-lora", "--json", "--k", "2"])
    assert rc == 0
    scales = {e["scale"] for e in strict_json(out)["lora"] if e["merged"]}
    assert scales == {MAX_LORA_SCALE} and math.isfinite(MAX_LORA_SCALE)
