"""The end-of-training figure draws exactly the session's history: laws, controls and the prediction."""

from __future__ import annotations

import pytest
import torch

from flowgeom.errors import FlowgeomError
from flowgeom.integrations.figure import drift_series, plot_drift
from flowgeom.integrations.session import MonitorSession


def test_figure_draws_the_history(tmp_path, tiny_llama):
    pytest.importorskip("transformers")
    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    session = MonitorSession(model, opt, every=2, out=tmp_path)
    g = torch.Generator().manual_seed(0)
    for k in range(6):
        ids = torch.randint(3, 64, (4, 16), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        session.before_step()
        opt.step()
        session.after_step()
        opt.zero_grad()
        session.measure(k + 1)
    out = session.finish()
    series = drift_series(session.history)
    assert series["eps"]["attn.vo"] == ([2, 4, 6], [h["eps/attn.vo"] for h in session.history])
    assert series["control"]["norm.W_V"][1] == [h["control/norm.W_V"] for h in session.history]
    assert series["pred"]["mlp.gated"][1] == [h["pred/mlp.gated"] for h in session.history]
    assert not any("@" in fam for kind in series.values() for fam in kind)  # per family only
    assert out["figure"] == str(tmp_path / "figures" / "conservation.png")
    drawn = plot_drift(session.history, tmp_path / "again.svg", title="t")
    assert drawn == series and (tmp_path / "again.svg").read_text().count("<path") > 10
    with pytest.raises(FlowgeomError, match="unknown extension"):
        plot_drift(session.history, tmp_path / "fig.txt", title="t")


def test_uncovered_blocks_are_said_not_skipped(monkeypatch, tmp_path):
    """A block no law covers is warned about when the session starts and named in its summary line."""
    import flowgeom.laws.monitor as monitor_mod
    from flowgeom.laws.locate import FlowgeomWarning, Located, Uncovered
    from flowgeom.nn import SwiGLU

    fake = Uncovered("blocks.9.mystery", "model_type 'mystery' is not in the family table")
    real = monitor_mod.locate_blocks
    monkeypatch.setattr(monitor_mod, "locate_blocks",
                        lambda model, **kw: Located(real(model, **kw).entry, real(model, **kw).uncovered + (fake,)))
    model = SwiGLU(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with pytest.warns(FlowgeomWarning, match="blocks.9.mystery"):
        session = MonitorSession(model, opt, out=tmp_path)
    model(torch.randn(8, 4)).pow(2).mean().backward()
    opt.step()
    session.measure(1)
    out = session.finish()
    assert out["uncovered"] == [fake.as_dict()] and "not measured: blocks.9.mystery" in out["line"]
