"""The monitor's batched evaluation (laws/batched.py) against the per-law evaluation in float64."""

import warnings

import pytest
import torch

from flowgeom.laws.batched import BatchedLaws
from flowgeom.laws.catalogue import catalogue
from flowgeom.laws.monitor import ConservationMonitor
from flowgeom.nn import build


def _per_law(laws, model):
    """The old path: every law's own ``evaluate`` on float64 copies of the parameters."""
    p = {n: w.detach().to(torch.float64) for n, w in model.named_parameters()}
    return torch.cat([law.evaluate(p).reshape(-1) for law in laws])


def _all_laws(entry):
    return list(entry.laws) + list(entry.controls) + list(entry.refuted)


def _assert_same(laws, model):
    params = {n: w.detach() for n, w in model.named_parameters()}
    batched = BatchedLaws(laws, params)
    new, old = batched(params), _per_law(laws, model)
    assert new.dtype == torch.float64 and new.shape == old.shape
    # each law's values agree to float64 round-off of its own scale (sums of squares are rounded differently)
    start = 0
    for law in laws:
        a, b = new[start:start + law.count], old[start:start + law.count]
        scale = float(b.abs().max()) + 1e-300
        assert float((a - b).abs().max()) <= 1e-12 * scale, law.name
        start += law.count
    return batched


@pytest.mark.parametrize("arch,opts", [("mha", {"positions": "rope", "d_k": 4}), ("mha", {}), ("swiglu", {}),
                                       ("moe", {"top_k": 2}), ("moe", {"top_k": 1}), ("relu2", {"bias": True}),
                                       ("linear2", {}), ("chain", {})])
def test_zoo_batched_equals_per_law(arch, opts):
    model = build(arch, seed=3, **opts).double()
    _assert_same(_all_laws(catalogue(model)), model)


def _hf_models():
    pytest.importorskip("transformers")
    from flowgeom.hf.tiny import SUPPORTED, tiny_model

    return SUPPORTED, tiny_model


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_every_hf_family_batched_equals_per_law(dtype):
    supported, tiny_model = _hf_models()
    from flowgeom.laws.locate import locate_blocks

    fallbacks = set()
    for mt in supported:
        overrides = {"rms_norm_eps": 0.0} if mt in ("qwen3", "olmoe") else {}  # the QK-norm scale laws too
        model = tiny_model(mt, seed=1, dtype=dtype, **overrides)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            laws = _all_laws(locate_blocks(model, warn=False).entry)
        assert laws, mt
        _assert_same(laws, model)
        fallbacks |= {law.family for law in laws if law.batch is None}
    # every family has a vectorised form except OLMoE's full-width γ law (evaluated per law)
    assert fallbacks <= {"attn.qk_norm_gamma", "moe.router_frozen"}, fallbacks


def test_peft_lora_batched_equals_per_law():
    peft = pytest.importorskip("peft")
    _, tiny_model = _hf_models()
    from flowgeom.laws.locate import locate_blocks

    model = peft.get_peft_model(tiny_model("llama", seed=0), peft.LoraConfig(r=3, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # B = 0 at PEFT's init: move it so that the law is not trivially AAᵀ
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(generator=torch.Generator().manual_seed(0))
    laws = _all_laws(locate_blocks(model, warn=False).entry)
    assert any(law.family == "lora.gram" for law in laws)
    _assert_same(laws, model)


def test_monitor_values_follow_training_and_group_same_shapes():
    """The batched values track in-place updates (views, not stale copies) and group one kernel per shape."""
    _, tiny_model = _hf_models()
    model = tiny_model("llama", seed=0, dtype=torch.float32, num_hidden_layers=3)
    mon = ConservationMonitor(model, warn=False)
    fams = {(t.family, t.kind) for t in mon.items}
    assert mon._batched.groups == len(fams)  # 3 layers × groups of one family: one kernel call each
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    ids = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    new = mon.values()
    assert not torch.equal(new, mon.h0)
    assert torch.allclose(new, _per_law([t.law for t in mon.items], model), rtol=1e-12, atol=1e-12 * float(new.abs().max()))


def test_a_wrong_batch_is_refused_not_silently_misplaced():
    from dataclasses import replace

    from flowgeom.errors import FlowgeomError
    from flowgeom.laws.batched import Batch, flat

    model = build("swiglu", seed=0).double()
    law = catalogue(model).laws[0]
    bad = replace(law, batch=Batch(flat, lambda p: (p[law.params[0]],)))  # the whole up weight: too many values
    params = {n: w.detach() for n, w in model.named_parameters()}
    with pytest.raises(FlowgeomError, match="Batch is wrong"):
        BatchedLaws([bad], params)(params)
