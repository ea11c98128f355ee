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


def test_the_title_is_whole_and_inside_the_saved_figure(tmp_path):
    """A long title (the README's momentum line) is re-wrapped, never cut: every word is drawn, and its bounding box
    lies inside the figure at the size the PNG is written."""
    from PIL import Image

    from flowgeom.integrations.figure import DPI, FIGSIZE, drift_figure

    history = [{"step": k, "eps/attn.vo": 1e-5 * k, "control/norm.W_V": 1e-3 * k, "pred/attn.vo": 1e-5 * k}
               for k in range(1, 9)]
    title = ("step 50, SGD(lr=0.01, momentum=0.9, weight_decay=0.01): 0 law families held, 3 broken (held: "
             "ε_law/ε_control < 0.1; worst attn.vo 1.9) — as expected: SGD with momentum: the gradient-flow laws are "
             "lost under momentum (Marcotte et al., ICML 2024 (Keep the momentum)); drift is expected, not a failure\n"
             "second line")
    fig, _ = drift_figure(history, title=title)
    fig.draw_without_rendering()  # runs the constrained layout, as savefig does
    box, frame = fig._suptitle.get_window_extent(), fig.bbox
    assert frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1, (box, frame)
    assert fig._suptitle.get_text().split() == title.split()  # whole: every word, in order
    axes = fig.axes[0].get_window_extent()
    assert axes.y1 <= box.y0  # above the plot, not over it
    plot_drift(history, tmp_path / "f.png", title=title)
    with Image.open(tmp_path / "f.png") as im:  # saved at the figure's own size: the box above is the saved one
        assert im.size == (round(FIGSIZE[0] * DPI), round(FIGSIZE[1] * DPI))


def test_the_session_figure_title_is_the_short_summary(tmp_path):
    from flowgeom.nn import SwiGLU

    model = SwiGLU(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    session = MonitorSession(model, opt, out=tmp_path)
    for k in range(3):
        model(torch.randn(8, 4, generator=torch.Generator().manual_seed(k))).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        session.measure(k + 1)
    out = session.finish()
    head, tag = out["title"].split("\n")
    assert head == "step 3, SGD(lr=0.01): 1 law family held, 0 broken"
    assert tag.startswith("as expected (discretisation drift, predicted ") and tag in out["line"]
