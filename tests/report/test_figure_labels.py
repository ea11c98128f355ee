"""Every report figure can be read: no tick labels drawn over each other, no text cut at the figure's edge.

Each figure is drawn at the size and dpi it is saved with (``Figure.savefig`` is
wrapped to run :func:`flowgeom.report.layout.label_problems` first), on data in the
ranges the quick tour produces: τ from 0.0025 to 0.04, the law runs' long labels,
the LM's and SmolLM2's roles, the MLP ablation's variants, the Villani orbit over
three decades of radius, the Darcy protocol's curves.
"""

from __future__ import annotations

import math

import pytest
from matplotlib.figure import Figure

from flowgeom.report import figures
from flowgeom.report.layout import label_problems


@pytest.fixture
def saved(monkeypatch):
    """The problems of every figure saved while the test runs, one list per figure, with its title."""
    found: list[tuple[str, list[str]]] = []
    original = Figure.savefig

    def savefig(self, fname, *args, **kwargs):
        title = " / ".join(filter(None, [ax.get_title() for ax in self.axes] + [getattr(self._suptitle, "_text", "")]))
        found.append((title, label_problems(self, dpi=kwargs.get("dpi"), tight=kwargs.get("bbox_inches") == "tight")))
        return original(self, fname, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return found


def _clean(found: list[tuple[str, list[str]]], count: int) -> None:
    assert len(found) == count, [title for title, _ in found]
    assert [(title, problems) for title, problems in found if problems] == []


# --- the check itself -----------------------------------------------------------------------------------------------

def test_the_check_finds_the_overlapping_minor_labels_of_a_narrow_log_axis():
    fig = figures.new_figure((5.5, 3.4))
    ax = fig.subplots()
    ax.plot([0.0025, 0.005, 0.01, 0.02, 0.04], [1e-6, 4e-6, 2e-5, 6e-5, 2e-4])
    ax.set_xscale("log")
    ax.set_yscale("log")
    problems = label_problems(fig, dpi=110)
    assert any("x tick labels" in p and "overlap" in p for p in problems), problems


def test_the_check_finds_a_cut_label_and_labels_of_two_panels_drawn_over_each_other():
    fig = figures.new_figure((4, 3))
    left, right = fig.subplots(1, 2)
    right.set_ylabel("a y label long enough to run into the panel on its left " * 2)
    left.set_title("a title far wider than its panel, so it runs off the figure " * 2)
    problems = label_problems(fig, dpi=100)
    assert any("cut by the figure's edge" in p for p in problems), problems
    assert any(p.startswith("axes 0") and "overlaps axes 1" in p for p in problems), problems
    assert not any("cut" in p for p in label_problems(fig, dpi=100, tight=True))  # a tight save grows the image


def test_rotated_labels_are_compared_by_their_own_rectangles():
    """Long labels at 20° overlap only as axis-aligned boxes; drawn, they are parallel strips apart."""
    fig = figures.new_figure((5.0, 3.4))
    ax = fig.subplots()
    ax.bar([0, 1], [1, 2])
    ax.set_xticks([0, 1])
    ax.set_xticklabels(["gate=softmax router_bias=False d_model=4 d_hidden=3 experts=3 s0",
                        "gate=softmax top_k=2 router_bias=False d_model=4 d_hidden=3 experts=3 s0"],
                       rotation=20, ha="right", fontsize=8)
    assert label_problems(fig, dpi=110, tight=True) == []
    ax.set_xticklabels(["a label " * 6, "a label " * 6], rotation=0, fontsize=8)  # flat: they do collide
    assert any("overlap" in p for p in label_problems(fig, dpi=110, tight=True))


# --- the report's figures -------------------------------------------------------------------------------------------

TAUS = [0.0025, 0.005, 0.01, 0.02, 0.04]


def test_tau_and_router_figures_label_the_step_sizes_without_overlap(tmp_path, saved):
    laws = [8.7e-7 * (t / TAUS[0]) ** 2 for t in TAUS]
    control = [1.3e-4 * t / TAUS[0] for t in TAUS]
    figures.curves(tmp_path / "tau-scaling.png", {"laws ε": (TAUS, laws), "control": (TAUS, control)},
                   title="conservation error at fixed k vs step size τ", xlabel="τ", ylabel="ε(k)", logx=True, logy=True)
    figures.curves(tmp_path / "router-sum.png", {"softmax": (TAUS, [1e-16] * 5), "sigmoid": (TAUS, control)},
                   title="router sum Σ_e W_e: error at fixed k vs τ", xlabel="τ", ylabel="ε", logx=True, logy=True)
    _clean(saved, 2)
    fig = figures.new_figure((5.5, 3.4))  # the τ axis still names at least two step sizes
    ax = fig.subplots()
    ax.plot(TAUS, laws)
    ax.set_xscale("log")
    figures._log_labels(ax.xaxis, TAUS)
    assert label_problems(fig, dpi=110) == []  # draws it
    shown = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
    assert len([loc for loc in ax.get_xticks() if TAUS[0] <= loc <= TAUS[-1]]) >= 3 and len(shown) >= 3


def test_log_axis_over_many_decades_keeps_matplotlib_labels(tmp_path, saved):
    radius = [10 ** (k / 4) for k in range(13)]  # 1 .. 1e3
    series = {f"{loss} + {reg}": (radius, [max(r ** p - 1, 1e-12) for r in radius])
              for loss in ("attention", "lora") for reg, p in (("none", 0.5), ("log", 1.0), ("power", 2.5))}
    figures.curves(tmp_path / "villani-orbit.png", series, title="V(θ) − V(θ₀) along the symmetry orbit",
                   xlabel="‖θ‖", ylabel="V − V₀", logx=True, logy=True)
    steps = list(range(0, 101, 10))
    figures.curves(tmp_path / "drift.png", {f"{a} lr=0.1 s0 {kind}": (steps[1:], [1e-5 * s * (10 if kind == "control"
                                                                                           else 1) for s in steps[1:]])
                                            for a in ("mha-rope-swiglu", "moe-top2-softmax") for kind in ("laws", "control")},
                   title="conservation error ε(k) in SGD training", xlabel="step k", ylabel="ε(k)", logy=True)
    _clean(saved, 2)


@pytest.mark.parametrize("labels", [
    ["activation=gelu d_model=6 d_hidden=8 s0", "activation=silu d_model=6 d_hidden=8 s0"],
    ["gate=softmax router_bias=False d_model=4 d_hidden=3 experts=3 s0",
     "gate=softmax top_k=2 router_bias=False d_model=4 d_hidden=3 experts=3 s0"],
    ["q", "k", "v", "o", "gate", "up", "down"],
    ["Res+ReLU", "Res+GELU", "Res+SiLU", "NoRes", "Res+None", "Res+Radial", "Res+Radial_RMS", "Res+ReLU+LN"],
])
def test_bar_figures(tmp_path, saved, labels):
    n = len(labels)
    figures.paired_bars(tmp_path / "counts.png", labels, [3] * n, [3] * n, names=("seed / catalogue", "numeric count"),
                        title="law counts: catalogue vs numeric engine", ylabel="conserved quantities")
    figures.log_bars(tmp_path / "violation.png", {lab: {"laws": 1e-16, "controls": 0.3} for lab in labels},
                     title="orthogonality check", ylabel="max |⟨∇h, g⟩|", threshold=1e-10, threshold_label="tolerance")
    _clean(saved, 2)


def test_darcy_figures(tmp_path, saved):
    from flowgeom.experiments import darcy, darcy_report
    from flowgeom.runs import RunFolder

    folder = RunFolder(tmp_path / "darcy")
    folder.start({"scale": "quick"}, resume=False)
    for reg in darcy.QUICK.regs:
        for step in range(0, 6001, 100):
            growth = 1 + step / 600 if reg == "none" else 1 + math.log1p(step / 600)
            folder.log({"phase": "langevin", "reg": reg, "step": step, "wq_norm": 4 * growth, "wk_norm": 4.2 * growth,
                        "test_rmse": 0.05 + 0.01 * growth, "gap": 0.002 * growth, "train_mse_norm": 0.1 / (1 + step)})
    summary = {"arms": {reg: {} for reg in darcy.QUICK.regs},
               "rate": {"eps": [0.1, 0.01, 0.001], "log_inv_eps": [2.3, 4.6, 6.9],
                        "steps": {reg: [100, 1000, None] for reg in darcy.QUICK.regs}}}
    darcy_report.figures(folder, summary)
    _clean(saved, 3)
