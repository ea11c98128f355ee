"""One torch thread for every test here: these models are tiny, and thread hand-offs dominate on a busy 2-core box."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
