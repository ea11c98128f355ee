"""Langevin takes named_parameters(), a plain list, or groups; a regulariser that needs names says how to pass them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flowgeom.errors import FlowgeomError
from flowgeom.langevin import Langevin, Regularizer, chain, select

LOG = Regularizer("log", lam=0.3)


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def _step(model: nn.Module, opt: Langevin) -> None:
    opt.zero_grad()
    model(torch.linspace(-1, 1, 12).view(4, 3)).pow(2).sum().backward()
    opt.step()


def _reference(names: tuple[str, ...], lrs: dict[str, float]) -> dict[str, torch.Tensor]:
    """θ − lr (g + ∇R) by hand (temperature 0), R on ``names`` only."""
    model = _net()
    model(torch.linspace(-1, 1, 12).view(4, 3)).pow(2).sum().backward()
    LOG.add_grad_([p for n, p in model.named_parameters() if n in names])
    return {n: (p - lrs.get(n, 0.1) * p.grad).detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("form", ["named_parameters", "groups"])
def test_named_forms_regularise_exactly_the_named_weights(form):
    model = _net()
    names = ("0.weight", "2.weight")
    params = model.named_parameters() if form == "named_parameters" else [
        {"params": [(n, p) for n, p in model.named_parameters() if n.startswith("0.")]},
        {"params": [(n, p) for n, p in model.named_parameters() if n.startswith("2.")], "lr": 0.05}]
    _step(model, Langevin(params, lr=0.1, temperature=0.0, grad_transform=LOG.transform(names)))
    lrs = {} if form == "named_parameters" else {"2.weight": 0.05, "2.bias": 0.05}
    want = _reference(names, lrs)
    for n, p in model.named_parameters():
        assert torch.allclose(p, want[n], rtol=1e-6, atol=1e-7), n


def test_plain_list_works_without_names_and_is_refused_with_them():
    model = _net()
    _step(model, Langevin(list(model.parameters()), lr=0.1, temperature=0.0, grad_transform=LOG.transform()))
    want = _reference(tuple(n for n, _ in _net().named_parameters()), {})
    assert all(torch.allclose(p, want[n], rtol=1e-6, atol=1e-7) for n, p in model.named_parameters())
    with pytest.raises(FlowgeomError) as info:  # refused when built, before any step
        Langevin(list(model.parameters()), lr=0.1, temperature=0.0, grad_transform=LOG.transform(["0.weight"]))
    assert str(info.value) == (
        "the gradient transform regularises parameters by name (0.weight) but the optimiser was given its parameters "
        "without names; pass the parameters with their names: Langevin(model.named_parameters(), …), or groups "
        "{'params': [(name, p) for name, p in model.named_parameters() if p.requires_grad]}")
    with pytest.raises(FlowgeomError, match=r"by name \(0\.weight\)"):  # a chain carries its parts' names
        Langevin(list(model.parameters()), lr=0.1, temperature=0.0,
                 grad_transform=chain(Regularizer("frobenius").transform(), LOG.transform(["0.weight"])))


def test_the_functional_keys_by_position_say_how_to_name_them():
    params = {"0": torch.ones(2, 2), "1": torch.ones(2)}
    with pytest.raises(FlowgeomError, match="given its parameters without names .*named_parameters"):
        LOG.transform(["model.lora_A.weight"])(params, params)


def test_wrong_names_and_mixed_groups_are_refused_by_name():
    model = _net()
    with pytest.raises(FlowgeomError, match="names 1.weight, which the optimiser was not given; its parameters: "
                                            "0.weight, 0.bias, 2.weight, 2.bias"):
        Langevin(model.named_parameters(), lr=0.1, temperature=0.0, grad_transform=LOG.transform(["1.weight"]))
    with pytest.raises(FlowgeomError, match="some parameter groups with names and some without"):
        Langevin([{"params": list(model[0].named_parameters())}, {"params": list(model[2].parameters())}],
                 lr=0.1, temperature=0.0)
    model[2].weight.requires_grad_(False)
    opt = Langevin(model.named_parameters(), lr=0.1, temperature=0.0, grad_transform=LOG.transform(["2.weight"]))
    with pytest.raises(FlowgeomError, match="'2.weight', which is not being trained .*frozen"):
        _step(model, opt)


def test_transform_takes_names_pairs_or_select_and_refuses_tensors():
    model = _net()
    grads = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    params = dict(model.named_parameters())
    by_name = LOG.transform(["0.weight"])(grads, params)
    by_pair = LOG.transform([("0.weight", model[0].weight)])(grads, params)
    by_select = LOG.transform(select(model, names=["0.weight"]))(grads, params)
    assert all(torch.equal(by_name[n], by_pair[n]) and torch.equal(by_name[n], by_select[n]) for n in grads)
    assert by_name["0.weight"].abs().sum() > 0 and by_name["0.bias"].abs().sum() == 0
    with pytest.raises(FlowgeomError, match="takes parameter names \\(str\\), got a Parameter"):
        LOG.transform([model[0].weight])
    with pytest.raises(FlowgeomError, match="got the string '0.weight'; write transform\\(\\['0.weight'\\]\\)"):
        LOG.transform("0.weight")


def test_peft_lora_trained_through_named_parameters():
    """Real PEFT: only the adapter factors train and only they are regularised; the numbers are add_grad_'s."""
    peft = pytest.importorskip("peft")

    def build():
        torch.manual_seed(1)
        model = peft.get_peft_model(nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)),
                                    peft.LoraConfig(r=2, lora_alpha=4, target_modules=["0", "2"], lora_dropout=0.0,
                                                    init_lora_weights="gaussian"))
        return model

    def loss(model):
        return model(torch.linspace(-1, 1, 20).view(5, 4)).pow(2).sum()

    model, twin = build(), build()
    lora = select(model, preset="lora")
    assert len(lora) == 4 and all(p.requires_grad for p in lora.values())
    opt = Langevin(model.named_parameters(), lr=0.1, temperature=0.0, grad_transform=LOG.transform(lora))
    opt.zero_grad()
    loss(model).backward()
    opt.step()
    loss(twin).backward()
    twin_lora = select(twin, preset="lora")
    LOG.add_grad_(twin_lora.values())
    with torch.no_grad():
        for name, p in twin.named_parameters():
            want = p - 0.1 * p.grad if p.requires_grad else p
            assert torch.allclose(dict(model.named_parameters())[name], want, rtol=1e-6, atol=1e-7), name
