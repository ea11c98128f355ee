"""One torch thread per test: the tiny models run 10× faster than with 2 threads fighting xdist workers."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
