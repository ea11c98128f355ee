"""PEFT LoRA laws A Aᵀ − BᵀB on real peft layers: orthogonality, count, one-step slope on a tiny Llama."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from one_step import one_step_changes  # noqa: E402

from flowgeom.hf.tiny import tiny_model  # noqa: E402
from flowgeom.laws import check, count  # noqa: E402
from flowgeom.laws.count import trainable_only  # noqa: E402
from flowgeom.laws.lora import lora_laws  # noqa: E402


class Wrapped(nn.Module):
    """A PEFT model of one layer as a module of one plain tensor; integer inputs for embeddings."""

    def __init__(self, inner: nn.Module, shape: tuple[int, ...], vocab: int | None = None):
        super().__init__()
        self.inner, self.shape, self.vocab = inner, shape, vocab

    def forward(self, x):
        return self.inner(x.long() if self.vocab else x)

    def sample_input(self, n, gen):
        if self.vocab:
            return torch.randint(0, self.vocab, (n, *self.shape), generator=gen).double()
        return torch.randn(n, *self.shape, generator=gen, dtype=torch.float64)


def _away_from_init(model: nn.Module, seed: int = 0) -> None:
    """PEFT starts at B = 0 (both norms then move at second order): move every trainable weight."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.5 * torch.randn(p.shape, generator=gen, dtype=p.dtype))


LAYERS = {
    "linear": (lambda: nn.Sequential(nn.Linear(6, 5)), dict(r=2), (6,), None),
    "linear_r3_rslora_bias": (lambda: nn.Sequential(nn.Linear(6, 5)), dict(r=3, use_rslora=True, lora_bias=True), (6,), None),
    "dora": (lambda: nn.Sequential(nn.Linear(6, 5)), dict(r=2, use_dora=True), (6,), None),
    "embedding": (lambda: nn.Sequential(nn.Embedding(7, 5)), dict(r=2), (3,), 7),
    "conv2d": (lambda: nn.Sequential(nn.Conv2d(2, 3, 2)), dict(r=2), (2, 3, 3), None),
}


@pytest.mark.parametrize("case", sorted(LAYERS))
def test_lora_law_orthogonal_and_count(case):
    build, options, shape, vocab = LAYERS[case]
    torch.manual_seed(0)  # PEFT initialises A from the global RNG
    model = peft.get_peft_model(build(), peft.LoraConfig(target_modules=["0"], **options)).double()
    _away_from_init(model)
    wrapped = Wrapped(trainable_only(model), shape, vocab)
    entry = lora_laws(wrapped)
    r = options["r"]
    assert [law.count for law in entry.laws] == [r * (r + 1) // 2]
    assert not any("base_layer" in n for law in entry.laws for n in law.params)  # frozen weights are no law
    report = check(wrapped, list(entry.laws) + list(entry.controls), n_fields=32, n_points=2)
    assert report.passed and report.max_violation < 1e-12
    assert all(v.max_violation > 1e-4 for v in report.verdicts if v.status == "control")
    result = count(wrapped)  # only the adapters (and DoRA's magnitude) are parameters of the wrapped copy
    assert result.laws == entry.count, result.gap


def test_dropout_keeps_the_law():
    torch.manual_seed(0)
    model = peft.get_peft_model(nn.Sequential(nn.Linear(6, 5)), peft.LoraConfig(target_modules=["0"], r=2, lora_dropout=0.5))
    model = model.double().train()
    _away_from_init(model)
    wrapped = Wrapped(trainable_only(model), (6,))
    entry = lora_laws(wrapped)
    report = check(wrapped, list(entry.laws) + list(entry.controls), n_fields=32, n_points=2)
    assert report.passed and any(v.max_violation > 1e-3 for v in report.verdicts if v.status == "control")


def test_frozen_and_uncovered_adapters_are_named():
    torch.manual_seed(0)
    model = peft.get_peft_model(nn.Sequential(nn.Linear(6, 5)), peft.LoraConfig(target_modules=["0"], r=2))
    for p in model.parameters():
        p.requires_grad_(False)
    entry = lora_laws(model)
    assert entry.laws == () and any("frozen" in n for n in entry.notes)
    mha = peft.get_peft_model(nn.Sequential(nn.MultiheadAttention(4, 2)), peft.LoraConfig(target_modules=["0"], r=2))
    entry = lora_laws(mha)
    assert entry.laws == () and any("MultiheadAttention" in n and "not covered" in n for n in entry.notes)


def test_one_step_on_tiny_llama_q_v_adapters():
    """One SGD step at τ = 1e-2, 1e-3, 1e-4: every A Aᵀ − BᵀB moves at τ² (slope 2), every ‖B‖²_F at τ (slope 1)."""
    torch.manual_seed(0)
    base = tiny_model("llama", seed=0, num_hidden_layers=2)
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"])).double()
    _away_from_init(model)
    entry = lora_laws(model)
    assert len(entry.laws) == 4 and len(entry.controls) == 4  # 2 layers × (q, v)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=gen)
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    slopes, _ = one_step_changes(model, entry.laws + entry.controls, ids)
    for item in entry.laws + entry.controls:
        assert abs(slopes[item.name] - (2 if item.status == "law" else 1)) < 0.2, (item.name, slopes[item.name])


def test_locate_reports_adapters_not_frozen_base():
    from flowgeom.laws.locate import locate_blocks

    model = peft.get_peft_model(tiny_model("llama", seed=0), peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    found = locate_blocks(model, warn=False)
    assert [law.family for law in found.entry.laws] == ["lora.gram"] * 4  # base weights frozen: no laws
    assert [c.family for c in found.entry.controls] == ["norm.lora_B"] * 4
    assert any("frozen" in n for n in found.entry.notes) and found.uncovered == ()


def test_monitor_groups_lora_laws_under_the_adapted_module():
    from flowgeom.laws.monitor import ConservationMonitor

    model = peft.get_peft_model(tiny_model("llama", seed=0, num_hidden_layers=1),
                                peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    for laws in (None, lora_laws(model)):  # located (block set by locate) and hand-given (block from the names)
        record = ConservationMonitor(model, laws, warn=False).step(0)
        blocks = sorted(k.split("@", 1)[1] for k in record if k.startswith(("eps/lora.gram@", "control/norm.lora_B@")))
        attn = "base_model.model.model.layers.0.self_attn"
        assert blocks == [f"{attn}.q_proj", f"{attn}.q_proj", f"{attn}.v_proj", f"{attn}.v_proj"], blocks
        assert not any("lora_" in k.split("@", 1)[1] for k in record if "@" in k)  # no …q_proj.lora_A block
