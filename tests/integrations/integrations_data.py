"""Tiny offline datasets for the integration tests."""

from __future__ import annotations

import torch


class TokenData(torch.utils.data.Dataset):
    """``n`` random sequences of ``length`` tokens < ``vocab``, seeded; labels = inputs (causal LM)."""

    def __init__(self, n: int = 64, length: int = 16, vocab: int = 64, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(3, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}
