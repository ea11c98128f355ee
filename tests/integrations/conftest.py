"""The tiny Llama fixture and an offline environment for the integration tests (nothing is downloaded;
the dataset is in integrations_data.py)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")  # never reach the network
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture
def tiny_llama():
    from flowgeom.hf.tiny import tiny_model

    def make(seed: int = 0, **overrides):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return tiny_model("llama", seed=seed, dtype=torch.float32, **overrides)
    return make
