"""ViT: patching, shapes, names, and the attention/SwiGLU laws holding inside it."""

import pytest
import torch

from flowgeom.errors import FlowgeomError
from flowgeom.laws import catalogue, check
from flowgeom.nn.vit import ViT, ViTConfig, patchify


def test_patchify_matches_unfold():
    x = torch.randn(2, 3, 8, 8)
    ref = torch.nn.functional.unfold(x, kernel_size=4, stride=4).transpose(1, 2)  # (B, P, C*p*p)
    assert torch.equal(patchify(x, 4), ref)


def test_shapes_names_and_errors():
    torch.manual_seed(0)
    vit = ViT(ViTConfig(image_size=8, channels=1, patch=4, d_model=8, n_layers=2, heads=2, d_k=4, d_hidden=6))
    assert vit(torch.randn(5, 8, 8)).shape == (5, 10)
    names = dict(vit.named_parameters())
    assert {"layers.1.self_attn.q_proj.weight", "layers.0.mlp.gate_proj.weight", "pos_embed", "head.weight"} <= set(names)
    with pytest.raises(FlowgeomError, match="expects images"):
        vit(torch.randn(2, 3, 8, 8))
    with pytest.raises(FlowgeomError, match="divide"):
        ViTConfig(image_size=10, patch=4)


def test_catalogue_laws_hold_in_the_vit():
    torch.manual_seed(1)
    vit = ViT(ViTConfig(image_size=4, channels=1, patch=2, d_model=6, n_layers=1, heads=2, d_k=2, d_hidden=3,
                        n_classes=3, norm="rmsnorm")).double()
    entry = catalogue(vit)
    assert {law.family for law in entry.laws} == {"attn.qk", "attn.vo", "swiglu.up_down"}
    report = check(vit, entry.laws + entry.controls, n_fields=16, n_points=2)
    assert report.passed, report.max_violation
    assert max(v.max_violation for v in report.verdicts if v.status == "control") > 1e-3
