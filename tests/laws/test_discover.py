"""discover() recovers exactly the catalogue's span of laws, and prints them in parameter names."""

import pytest
import torch
from torch import nn
from torch.func import hessian, jacrev

from flowgeom.errors import FlowgeomError
from flowgeom.laws.catalogue import laws_of
from flowgeom.laws.discover import discover, format_law
from flowgeom.laws.fields import ParamLayout, shape_sampler
from flowgeom.nn import build


def _coefficients(q: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """h = θᵀQθ + bᵀθ -> [Q's upper triangle | b] (one row)."""
    iu = torch.triu_indices(q.shape[0], q.shape[0])
    return torch.cat([q[iu[0], iu[1]], b])


def _catalogue_rows(model: nn.Module) -> torch.Tensor:
    """Independent route: Hessian and gradient at 0 of the catalogue's evaluate (h quadratic => exact)."""
    model = model.double()
    layout = ParamLayout.of(model)
    zero = torch.zeros(layout.size, dtype=torch.float64)
    rows = []
    for law in laws_of(model):
        fn = lambda t, law=law: law.evaluate(layout.unflatten(t))  # noqa: E731
        hs, gs = hessian(fn)(zero), jacrev(fn)(zero)  # (count, D, D), (count, D)
        rows += [_coefficients(h / 2, g) for h, g in zip(hs, gs)]
    return torch.stack(rows) if rows else torch.zeros(0, layout.size * (layout.size + 1) // 2 + layout.size)


def _rank(m: torch.Tensor) -> int:
    if m.shape[0] == 0:
        return 0
    s = torch.linalg.svdvals(m)
    return int((s > 1e-7 * s[0]).sum())


CASES = [
    ("relu2", dict(d_in=3, width=2, d_out=2)),
    ("relu2", dict(d_in=2, width=2, d_out=2, bias=True)),
    ("linear2", dict(d_in=3, width=2, d_out=3)),
    ("ffn", dict(d_model=2, d_hidden=3, activation="gelu")),
    ("swiglu", dict(d_model=3, d_hidden=2)),
    ("mha", dict(d_model=3, heads=1, d_k=2, d_v=2)),
    ("mha", dict(d_model=3, heads=1, d_k=2, d_v=1, positions="sinusoidal")),
    ("mha", dict(d_model=2, heads=1, d_k=4, d_v=1, positions="rope")),
    ("moe", dict(d_model=2, d_hidden=1, experts=2)),
    ("moe", dict(d_model=2, d_hidden=1, experts=3, top_k=2, router_bias=True)),
    ("moe", dict(d_model=2, d_hidden=1, experts=2, gate="sigmoid")),
    ("chain", dict(widths="2,2,3")),
]


@pytest.mark.parametrize("name,opts", CASES, ids=[f"{n}-{'-'.join(f'{k}{v}' for k, v in o.items())}" for n, o in CASES])
def test_discover_spans_exactly_the_catalogue(name, opts):
    model = build(name, seed=0, **opts)
    res = discover(model, seed=0)
    found = torch.stack([_coefficients(law.quadratic, law.linear) for law in res.laws]) if res.laws else _catalogue_rows(model)[:0]
    known = _catalogue_rows(model)
    assert len(res.laws) == known.shape[0] == res.expected
    assert _rank(found) == _rank(known) == _rank(torch.cat([found, known])) == len(res.laws)
    assert res.max_violation < 1e-9


def test_swiglu_laws_print_as_row_and_column_norms():
    res = discover(build("swiglu", seed=0, d_model=3, d_hidden=2))
    assert [law.formula for law in res.laws] == [
        f"‖up_proj.weight[{i},:]‖² − ‖down_proj.weight[:,{i}]‖²" for i in range(2)
    ]


def test_linear2_gram_entries_and_moe_router_sums():
    lin = [law.formula for law in discover(build("linear2", seed=0, d_in=2, width=2, d_out=2)).laws]
    assert "⟨up_proj.weight[0,:], up_proj.weight[1,:]⟩ − ⟨down_proj.weight[:,0], down_proj.weight[:,1]⟩" in lin
    moe = discover(build("moe", seed=0, d_model=2, d_hidden=1, experts=2))
    assert {"Σ router.weight[:,0]", "Σ router.weight[:,1]"} <= {law.formula for law in moe.laws}
    assert any("products of linear laws" in n for n in moe.notes)


class Triple(nn.Module):
    """f(x) = u·v·w·x with scalars: the planted laws u² − v², u² − w² (rescalings keeping uvw)."""

    def __init__(self):
        super().__init__()
        self.u, self.v, self.w = (nn.Parameter(torch.tensor(s)) for s in (0.7, -1.3, 0.4))

    def forward(self, x):
        return self.u * self.v * self.w * x


def test_planted_scalar_laws_and_evaluate():
    res = discover(Triple(), shape_sampler((2,)))
    assert [law.formula for law in res.laws] == ["u² − w²", "v² − w²"]
    theta = torch.tensor([0.3, 2.0, 1.0], dtype=torch.float64)
    assert torch.isclose(res.laws[1].evaluate(theta), torch.tensor(3.0, dtype=torch.float64))
    assert res.expected is None


def test_format_law_falls_back_to_coefficients():
    layout = ParamLayout(("w",), ((2, 2),))
    q = torch.zeros(4, 4, dtype=torch.float64)
    q[0, 3] = q[3, 0] = 0.5  # w[0,0]·w[1,1]
    assert format_law(q, torch.zeros(4, dtype=torch.float64), layout) == "w[0, 0]·w[1, 1]"


def test_bad_degree_and_size():
    with pytest.raises(FlowgeomError, match="degree 3"):
        discover(build("swiglu"), degree=3)
    with pytest.raises(FlowgeomError, match="exceeds the limit of .*pass max_parameters="):
        discover(build("swiglu"), max_parameters=50)


def test_degree_one_finds_only_linear_laws():
    res = discover(build("moe", seed=0, d_model=2, d_hidden=1, experts=2), degree=1)
    assert sorted(law.formula for law in res.laws) == ["Σ router.weight[:,0]", "Σ router.weight[:,1]"]


def test_input_shape_keyword():
    from torch import nn

    chain = nn.Sequential(nn.Linear(2, 3, bias=False), nn.ReLU(), nn.Linear(3, 2, bias=False))
    res = discover(chain, input_shape=(2,), seed=0)
    assert len(res.laws) == 3 and all("0.weight" in law.formula and "2.weight" in law.formula for law in res.laws)


def test_progress_counts_the_points():
    calls = []
    res = discover(build("swiglu", seed=0, d_model=2, d_hidden=1), progress=lambda *a: calls.append(a))
    assert calls[-1] == ("solving the symmetry system", res.points, res.points)
    assert [done for stage, done, _ in calls if stage.startswith("fields")][-1] == res.points


class _LayerNormMLP(nn.Module):
    def __init__(self, d: int = 4, m: int = 3):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up_proj = nn.Linear(d, m, bias=False)
        self.down_proj = nn.Linear(m, d, bias=False)

    def forward(self, x):
        return self.down_proj(torch.relu(self.up_proj(self.norm(x))))


def test_layernorm_mlp_one_law_per_hidden_unit_and_per_norm_feature():
    # The plain RREF gave feature 0's law as an 8-term sum (minus every unit's law); the sparse basis does not.
    res = discover(_LayerNormMLP(), input_shape=(4,), seed=0)
    norm = [f"norm.weight[{j}]² + norm.bias[{j}]² − ‖up_proj.weight[:,{j}]‖²" for j in range(4)]
    units = [f"‖up_proj.weight[{i},:]‖² − ‖down_proj.weight[:,{i}]‖²" for i in range(3)]
    assert [law.formula for law in res.laws] == norm + units  # grouped: norm laws first (module order)
    assert [law.params for law in res.laws] == [("norm.weight", "norm.bias", "up_proj.weight")] * 4 + \
        [("up_proj.weight", "down_proj.weight")] * 3
    groups = res.to_dict()["groups"]
    assert [len(g["laws"]) for g in groups] == [4, 3] and groups[1]["params"] == ["up_proj.weight", "down_proj.weight"]


def test_attention_vo_laws_are_per_head():
    res = discover(build("mha", seed=0, d_model=3, heads=2, d_k=1, d_v=2))
    vo = [law for law in res.laws if law.params == ("v_proj.weight", "o_proj.weight")]
    assert len(vo) == 2 * 3  # per head: d_v(d_v+1)/2
    diagonal = {f"‖v_proj.weight[{a},:]‖² − ‖o_proj.weight[:,{a}]‖²" for a in range(4)}
    assert diagonal <= {law.formula for law in vo}
    d_model, d_v, start = 3, 2, 12  # θ = q (2×3), k (2×3), v (4×3), o (3×4), flattened row-major
    for law in vo:  # every V/O law reads the v_proj rows of one head only
        used = law.quadratic.abs().sum(1)[start : start + 4 * d_model]  # (12,) the v_proj coordinates
        heads = {int(i) // d_model // d_v for i in torch.nonzero(used).flatten()}
        assert len(heads) == 1, (law.formula, heads)


def test_sparsify_keeps_the_span_and_lowers_the_support():
    from flowgeom.laws.discover import _sparsify

    sparse = torch.zeros(3, 12, dtype=torch.float64)
    sparse[0, :2], sparse[1, 4:6], sparse[2, 8:11] = 1.0, torch.tensor([1.0, -2.0]), torch.tensor([1.0, 1.0, 3.0])
    mixed = torch.tensor([[1.0, 0, 0], [1.0, 1.0, 0], [1.0, 1.0, 1.0]], dtype=torch.float64) @ sparse  # dense combos
    out = _sparsify(mixed)
    assert int((out != 0).sum()) == int((sparse != 0).sum()) < int((mixed != 0).sum())
    assert torch.linalg.matrix_rank(torch.cat([out, sparse])) == 3


def test_latex_of_a_law():
    from flowgeom.laws.discover import to_latex

    assert to_latex("‖up_proj.weight[0,:]‖² − ‖down_proj.weight[:,0]‖²") == (
        r"\lVert \mathtt{up\_proj.weight}[0,:] \rVert^2 - \lVert \mathtt{down\_proj.weight}[:,0] \rVert^2")
    assert to_latex("Σ router.weight[:,1]") == r"\sum \mathtt{router.weight}[:,1]"


class _GatedAttention(nn.Module):
    """Multi-head attention with an elementwise sigmoid gate on the heads' outputs (gated attention)."""

    def __init__(self, d: int = 3, heads: int = 2, d_k: int = 1, d_v: int = 2):
        super().__init__()
        self.heads, self.d_k, self.d_v = heads, d_k, d_v
        self.q_proj = nn.Linear(d, heads * d_k, bias=False)
        self.k_proj = nn.Linear(d, heads * d_k, bias=False)
        self.v_proj = nn.Linear(d, heads * d_v, bias=False)
        self.g_proj = nn.Linear(d, heads * d_v, bias=False)
        self.o_proj = nn.Linear(heads * d_v, d, bias=False)

    def forward(self, x):  # (T, d): the engine calls forward on one input, without a batch dimension
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.heads, self.d_k).transpose(0, 1)  # (H, T, d_k)
        k = self.k_proj(x).view(t, self.heads, self.d_k).transpose(0, 1)
        v = self.v_proj(x).view(t, self.heads, self.d_v).transpose(0, 1)  # (H, T, d_v)
        a = (torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v).transpose(0, 1).reshape(t, -1)  # (T, H·d_v)
        return self.o_proj(a * torch.sigmoid(self.g_proj(x)))


def test_gated_attention_keeps_only_the_per_head_diagonal_vo_laws():
    # The gate acts on each value channel alone, so of V_iV_iᵀ − O_iᵀO_i only the diagonal survives.
    torch.manual_seed(0)
    res = discover(_GatedAttention(), input_shape=(2, 3), seed=0)
    vo = [law.formula for law in res.laws if law.params == ("v_proj.weight", "o_proj.weight")]
    assert vo == [f"‖v_proj.weight[{a},:]‖² − ‖o_proj.weight[:,{a}]‖²" for a in range(4)]
    qk = [law.formula for law in res.laws if law.params == ("q_proj.weight", "k_proj.weight")]
    assert qk == [f"‖q_proj.weight[{h},:]‖² − ‖k_proj.weight[{h},:]‖²" for h in range(2)]
    assert len(res.laws) == 6
