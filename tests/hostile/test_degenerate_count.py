"""A block whose output is constant in its weights (rank 0) is named degenerate, and no laws are counted.

``laws count hf:mixtral:moe --config num_experts_per_tok=0`` routes every token
to no expert: the output is zero whatever the weights, so all 240 parameters
would "count" as laws (issue 35 §4). The library raises, the CLI says so in
one line and exits 2; a live block still counts.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flowgeom.errors import FlowgeomError
from flowgeom.laws import count
from flowgeom.laws.count import DEGENERATE


class _Dead(nn.Module):
    """An output that does not depend on the parameters (rank 0 by construction)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 4))

    def forward(self, x):  # x (B, 4)
        return 0.0 * (x @ self.w.T)  # (B, 3)


class _Live(_Dead):
    def forward(self, x):
        return x @ self.w.T


def test_rank_zero_is_refused_as_degenerate_and_a_live_block_counts():
    with pytest.raises(FlowgeomError) as info:
        count(_Dead(), input_shape=(4,), dtype=torch.float64)
    assert str(info.value) == DEGENERATE and "constant" in DEGENERATE and "degenerate" in DEGENERATE
    live = count(_Live(), input_shape=(4,), dtype=torch.float64)
    assert live.rank == 12 and live.laws == 0


def test_hf_moe_with_no_expert_per_token_is_refused(cli, strict_json):
    pytest.importorskip("transformers")
    for extra in ([], ["--json"]):
        rc, out, err = cli(["laws", "count", "hf:mixtral:moe", "--config", "num_experts_per_tok=0", *extra])
        assert rc == 2 and out == "" and err.strip() == f"flowgeom: error: {DEGENERATE}"
    rc, out, _ = cli(["laws", "count", "hf:mixtral:moe", "--json"])  # the default config is not degenerate
    data = strict_json(out)
    assert rc == 0 and data["rank"] > 0 and data["laws"] < data["parameters"]
