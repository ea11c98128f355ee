"""Fixtures shared by the preset tests: the conserve CLI driven with a recorder in place of training."""

from __future__ import annotations

import pytest

from flowgeom.cli import main
from flowgeom.experiments import conservation, conservation_grid


@pytest.fixture
def conserve_run_configs(monkeypatch, tmp_path):
    """``configs(*flags)``: the run configs ``flowgeom conserve run FLAGS --regime sgd`` would train, none trained."""
    def configs(*flags):
        seen = []

        def record(cfg, out, *, resume=False, **_):
            seen.append(cfg)
            return {"final": {}}

        monkeypatch.setattr(conservation, "run_conservation", record)
        monkeypatch.setattr(conservation_grid, "plot_grid", lambda rows, path, title: path)
        assert main(["conserve", "run", *flags, "--regime", "sgd", "--out", str(tmp_path), "--json"]) == 0
        return seen

    return configs
