"""One gradient-descent step at several step sizes τ, shared by the HF law tests.

A quantity h kept by gradient flow changes under one GD step θ → θ − τ∇L by
``Δh = τ²·q(∇L) + O(τ³)`` if h is quadratic (a law: log-slope 2 in τ), by
round-off only if it is linear (router sum, k bias), and by ``τ·⟨∇h, ∇L⟩``
if it is not kept (a control: slope 1).
"""

from __future__ import annotations

import math

import torch

TAUS = (1e-2, 1e-3, 1e-4)


def log_slope(changes, taus=TAUS) -> float:
    """``d log|Δh| / d log τ`` between the largest and the smallest τ (``changes[i]`` measured at ``taus[i]``)."""
    first, last = (math.log(max(c, 1e-300)) for c in (changes[0], changes[-1]))
    return (first - last) / (math.log(taus[0]) - math.log(taus[-1]))


def one_step_changes(model, items, ids: torch.Tensor, taus=TAUS) -> tuple[dict[str, float], dict[str, float]]:
    """``(slopes, rel)`` per item (a law or control with ``evaluate``, ``params``, ``name``) after one step on ``ids``.

    ``slopes[name]`` is :func:`log_slope` of ``‖h(θ − τ∇L) − h(θ)‖`` over ``taus``;
    ``rel[name] = ‖Δh‖/(τ‖∇_params L‖)`` at the smallest τ, the first-order size of the change.
    """
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    grads = dict(zip(named, torch.autograd.grad(model(input_ids=ids, labels=ids).loss, list(named.values()))))
    theta = {n: p.detach().clone() for n, p in model.named_parameters()}
    slopes, rel = {}, {}
    for item in items:
        assert item.name not in slopes, f"two items named {item.name}"  # one row each, none hidden
        h0 = item.evaluate(theta)
        deltas = [float((item.evaluate({n: v - t * grads.get(n, 0) for n, v in theta.items()}) - h0).norm())
                  for t in taus]
        slopes[item.name] = log_slope(deltas, taus)
        scale = math.sqrt(sum(float(grads[n].norm()) ** 2 for n in item.params if n in grads))
        rel[item.name] = deltas[-1] / (taus[-1] * scale)
    return slopes, rel
