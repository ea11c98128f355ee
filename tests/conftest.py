import os

import matplotlib
import pytest
import torch
from hypothesis import settings

# Derandomised: every run of the suite explores the same examples, so a CI
# result is reproducible; set HYPOTHESIS_PROFILE=explore to search afresh.
settings.register_profile("repeatable", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))

matplotlib.use("Agg")
os.environ.setdefault("MPLBACKEND", "Agg")


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """One torch thread per test: tiny models run ~10× faster than with threads fighting xdist workers."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
