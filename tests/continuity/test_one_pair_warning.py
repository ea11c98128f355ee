"""Statistics over a single layer pair are flagged: a mean ± sd of one value reads like a measurement."""

from __future__ import annotations

import torch
from safetensors.torch import save_file

from flowgeom.continuity.analyze import AnalyzeConfig, analyze


def _checkpoint(path, layers: int) -> str:
    g = torch.Generator().manual_seed(0)
    save_file({f"model.layers.{l}.self_attn.{r}_proj.weight": torch.randn(8, 8, generator=g)
               for l in range(layers) for r in "qk"}, str(path))
    return str(path)


def test_one_pair_is_warned_about(tmp_path):
    report = analyze(_checkpoint(tmp_path / "two.safetensors", 2), AnalyzeConfig(k=2))
    assert report["roles"]["q"]["v1_std"] == 0.0  # the number the warning is about
    [warning] = [w for w in report["warnings"] if "one layer pair" in w]
    assert warning.startswith("roles q, k: one layer pair at distance 1")


def test_three_layers_are_not(tmp_path):
    report = analyze(_checkpoint(tmp_path / "three.safetensors", 3), AnalyzeConfig(k=2))
    assert not [w for w in report["warnings"] if "one layer pair" in w]
