"""A count whose every field is zero (rank 0) says it is degenerate instead of reporting "precision: full".

``laws count hf:mixtral:moe --config num_experts_per_tok=0`` routes every token
to no expert: the output is zero whatever the weights, so all 240 parameters
"count" as laws. The text and JSON outputs now carry a note naming that.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flowgeom.laws import count
from flowgeom.laws.count import DEGENERATE_NOTE


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


def test_rank_zero_count_carries_the_degenerate_note():
    dead = count(_Dead(), input_shape=(4,), dtype=torch.float64)
    assert dead.rank == 0 and dead.laws == dead.parameters == 12 and dead.notes[0] == DEGENERATE_NOTE
    live = count(_Live(), input_shape=(4,), dtype=torch.float64)
    assert live.rank > 0 and DEGENERATE_NOTE not in live.notes


def test_hf_moe_with_no_expert_per_token_is_flagged(cli, strict_json):
    pytest.importorskip("transformers")
    rc, out, _ = cli(["laws", "count", "hf:mixtral:moe", "--config", "num_experts_per_tok=0"])
    assert rc == 0
    assert f"note: {DEGENERATE_NOTE}" in " ".join(out.split())  # rich may wrap the line
    assert "precision: none" in out and "precision: full" not in out
    rc, out, _ = cli(["laws", "count", "hf:mixtral:moe", "--config", "num_experts_per_tok=0", "--json"])
    data = strict_json(out)
    assert rc == 0 and data["rank"] == 0 and data["notes"][0] == DEGENERATE_NOTE
    rc, out, _ = cli(["laws", "count", "hf:mixtral:moe", "--json"])  # the default config is not degenerate
    assert rc == 0 and DEGENERATE_NOTE not in strict_json(out)["notes"]
