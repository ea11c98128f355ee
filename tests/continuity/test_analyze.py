"""The analyzer on planted-continuity checkpoints whose answer is known, and the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from synthetic_checkpoints import llama_state, planted_stack
from safetensors.torch import save_file

from flowgeom.cli import main
from flowgeom.continuity import AnalyzeConfig, analyze, verdict


def _planted_state(layers=6, d=48, hidden=64):
    """q shares v1 across layers, down shares u1, v is independent noise (seed 001's pattern, planted)."""
    q = planted_stack(layers, d, d, shared="in", seed=1)
    down = planted_stack(layers, d, hidden, shared="out", seed=2)
    v = planted_stack(layers, d, d, shared="none", seed=3)
    sd = {}
    for i in range(layers):
        sd[f"model.layers.{i}.self_attn.q_proj.weight"] = q[i]
        sd[f"model.layers.{i}.self_attn.v_proj.weight"] = v[i]
        sd[f"model.layers.{i}.mlp.down_proj.weight"] = down[i]
    return sd


def test_planted_continuity_is_found():
    report = analyze(_planted_state(), AnalyzeConfig(k=2, distances=(1, 2)))
    q, v, down = (report["roles"][r] for r in ("q", "v", "down"))
    assert q["v1"] > 0.99 and q["verdict"] == "input-continuous"
    assert down["u1"] > 0.99 and down["verdict"] == "output-continuous"
    assert v["verdict"] == "neither" and v["v1_ratio"] < 3 and v["u1_ratio"] < 3
    assert q["u1"] < 0.5 and down["v1"] < 0.5
    assert len(q["pairs"]) == 5 + 4 and {p["distance"] for p in q["pairs"]} == {1, 2}
    assert q["by_distance"]["2"]["v1"] > 0.99
    # |cos| matches an independent full SVD on one pair
    sd = _planted_state()
    A, B = sd["model.layers.2.self_attn.v_proj.weight"].double(), sd["model.layers.3.self_attn.v_proj.weight"].double()
    va, vb = torch.linalg.svd(A)[2][0], torch.linalg.svd(B)[2][0]
    pair = next(p for p in v["pairs"] if p["a"] == 2 and p["b"] == 3)
    assert pair["v1"] == pytest.approx(float((va @ vb).abs()), abs=1e-6)


def test_independent_random_layers_sit_at_baseline():
    report = analyze(llama_state(layers=12, d=64, kv=32, hidden=96, seed=5), AnalyzeConfig(k=4, roles=("q", "gate")))
    for role in ("q", "gate"):
        r = report["roles"][role]
        assert r["verdict"] == "neither"
        assert 0.3 < r["v1_ratio"] < 2.0 and 0.3 < r["u1_ratio"] < 2.0
        assert r["metrics"]["gram_in"]["ratio"] == pytest.approx(1.0, abs=0.15)


def test_batched_equals_streamed():
    sd = _planted_state()
    a = analyze(sd, AnalyzeConfig(k=3, batch=1))
    b = analyze(sd, AnalyzeConfig(k=3, batch=4))
    for role in a["roles"]:
        for pa, pb in zip(a["roles"][role]["pairs"], b["roles"][role]["pairs"]):
            assert pa["v1"] == pytest.approx(pb["v1"], abs=1e-8) and pa["gram_out"] == pytest.approx(pb["gram_out"])


def test_verdict_rule():
    assert verdict(5.0, 1.0, 3.0) == "input-continuous"
    assert verdict(1.0, 3.0, 3.0) == "output-continuous"
    assert verdict(4.0, 4.0, 3.0) == "input+output-continuous"
    assert verdict(2.9, None, 3.0) == "neither"


def test_cli_json_figure_and_out(tmp_path, capsys):
    path = tmp_path / "m.safetensors"
    save_file(_planted_state(), path)
    fig, out = tmp_path / "fig.png", tmp_path / "r.json"
    assert main(["continuity", "analyze", str(path), "--json", "--k", "2", "--figure", str(fig), "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert set(printed) >= {"layers", "roles"} and printed["layers"] == 6
    assert set(printed["roles"]["q"]) >= {"v1", "u1", "v1_baseline", "u1_baseline", "pairs", "verdict"}
    assert json.loads(out.read_text())["roles"]["down"]["verdict"] == "output-continuous"
    assert fig.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["continuity", "analyze", str(path), "--k", "2", "--roles", "q,down"]) == 0
    table = capsys.readouterr().out
    assert "input-continuous" in table and "output-continuous" in table


@pytest.mark.parametrize("mutate,msg", [
    (lambda sd: sd.__setitem__("model.layers.3.mlp.down_proj.weight", torch.full((48, 64), float("nan"))), "NaN"),
    (lambda sd: sd.__setitem__("model.layers.3.mlp.down_proj.weight", torch.zeros(48, 65)), "changes shape"),
    (lambda sd: [sd.pop(k) for k in list(sd) if ".layers.0." not in k], "only 1 layer"),
    (lambda sd: sd.__setitem__("model.layers.2.self_attn.q_proj.weight", torch.zeros(48, 48)), "all zeros"),
])
def test_cli_bad_input_exit_2_and_writes_nothing(tmp_path, capsys, mutate, msg):
    sd = _planted_state()
    mutate(sd)
    path = tmp_path / "m.safetensors"
    save_file(sd, path)
    fig, out = tmp_path / "fig.png", tmp_path / "r.json"
    code = main(["continuity", "analyze", str(path), "--figure", str(fig), "--out", str(out), "--k", "2"])
    err = capsys.readouterr().err
    assert code == 2 and msg in err and err.count("\n") == 1
    assert not fig.exists() and not out.exists() and list(tmp_path.iterdir()) == [path]


def test_cli_usage_errors(tmp_path, capsys):
    assert main(["continuity", "analyze", "builtin:nope"]) == 2
    assert "builtin:smollm2" in capsys.readouterr().err
    assert main(["continuity", "analyze", str(tmp_path), "--figure", "x.gif"]) == 2
    assert main(["continuity", "analyze", str(tmp_path)]) == 2
    assert "holds no safetensors" in capsys.readouterr().err


def test_custom_role_cli(tmp_path, capsys):
    stack = planted_stack(4, 10, 10, shared="in", seed=4)
    save_file({f"blocks.{i}.wq.weight": stack[i] for i in range(4)}, tmp_path / "c.safetensors")
    assert main(["continuity", "analyze", str(tmp_path / "c.safetensors"), "--json", "--k", "2",
                 "--role", r"wq=blocks\.(\d+)\.wq\.weight"]) == 0
    assert json.loads(capsys.readouterr().out)["roles"]["wq"]["verdict"] == "input-continuous"
    assert main(["continuity", "analyze", str(tmp_path / "c.safetensors"), "--role", "wq=blocks"]) == 2
    assert "capturing the layer index" in capsys.readouterr().err


@pytest.mark.slow
def test_builtin_minilm_end_to_end():
    report = analyze("builtin:minilm", AnalyzeConfig(k=4, max_layers=3, roles=("q", "o")))
    assert report["scheme"] == "bert" and report["layers"] == 3
    assert report["roles"]["q"]["v1_baseline"] == pytest.approx(0.0407, abs=1e-3)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_solvers_and_no_gram_agree_with_the_default(dtype):
    """Dense ?syevr, block Krylov and --no-gram give the same per-pair values; --no-gram only drops gram_*."""
    sd = _planted_state()
    ref = analyze(sd, AnalyzeConfig(k=3, dtype=dtype, solver="dense"))
    kry = analyze(sd, AnalyzeConfig(k=3, dtype=dtype, solver="krylov"))
    lean = analyze(sd, AnalyzeConfig(k=3, dtype=dtype, gram=False))
    tol = 1e-4 if dtype == "float32" else 1e-8  # top pair; pairs 2..k converge to a 1e-5 residual in Krylov
    for role, r in ref["roles"].items():
        assert "gram_in" not in lean["roles"][role]["metrics"] and "gram_in" in r["metrics"]
        assert lean["roles"][role]["verdict"] == r["verdict"] == kry["roles"][role]["verdict"]
        for pa, pb, pc in zip(r["pairs"], kry["roles"][role]["pairs"], lean["roles"][role]["pairs"]):
            for key, t in (("v1", tol), ("u1", tol), ("subspace_in", 1e-4), ("subspace_out", 1e-4)):
                assert pa[key] == pytest.approx(pb[key], abs=t) and pa[key] == pytest.approx(pc[key], abs=t)


def test_analysis_restores_torch_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        analyze(_planted_state(layers=3), AnalyzeConfig(k=2))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_cli_solver_no_gram_and_threads(tmp_path, capsys):
    path = tmp_path / "m.safetensors"
    save_file(_planted_state(), path)
    assert main(["continuity", "analyze", str(path), "--json", "--k", "2", "--solver", "krylov", "--no-gram",
                 "--threads", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"]["solver"] == "krylov" and report["config"]["gram"] is False
    assert "gram_out" not in report["roles"]["q"]["pairs"][0]
    assert main(["continuity", "analyze", str(path), "--k", "2", "--no-gram"]) == 0
    table = capsys.readouterr().out
    assert "gram in" not in table and "sub in" in table
    with pytest.raises(SystemExit) as exc:  # argparse choices
        main(["continuity", "analyze", str(path), "--solver", "qr"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:  # --threads is checked by argparse (1..os.cpu_count())
        main(["continuity", "analyze", str(path), "--threads", "0"])
    assert exc.value.code == 2


def test_report_source_of_in_memory_weights_is_a_label_not_their_repr():
    report = analyze(llama_state(layers=3, seed=5), AnalyzeConfig(k=2, roles=("q",)))
    assert report["source"] == "state dict"


def test_every_distance_must_leave_a_pair():
    """A distance beyond the layers used to crash the summary (mean of no pairs); it is refused up front."""
    from flowgeom.errors import FlowgeomError

    with pytest.raises(FlowgeomError, match="--distance 6 leaves no pair among the 6 layers"):
        analyze(_planted_state(), AnalyzeConfig(k=2, distances=(1, 6)))
    report = analyze(_planted_state(), AnalyzeConfig(k=2, distances=(1, 5)))  # the largest that fits: one pair
    assert [p["distance"] for p in report["roles"]["q"]["pairs"]].count(5) == 1


def test_meta_integer_and_unreadable_sources_are_one_clear_error():
    """A model built on the meta device, integer (quantised-code) weights under a role, and a source of the
    wrong type used to raise torch/TypeErrors from deep inside."""
    from flowgeom.errors import FlowgeomError

    state = _planted_state()
    with pytest.raises(FlowgeomError, match="meta device"):
        analyze({k: torch.empty(v.shape, device="meta") for k, v in state.items()}, AnalyzeConfig(k=2))
    codes = {k: (v * 100).round().to(torch.int8) if "q_proj" in k else v for k, v in state.items()}
    with pytest.raises(FlowgeomError, match=r"role q\) has dtype int8: the integer codes of a quantised"):
        analyze(codes, AnalyzeConfig(k=2))
    assert "q" not in analyze(codes, AnalyzeConfig(k=2, roles=("v", "down")))["roles"]  # the fix it names works
    with pytest.raises(FlowgeomError, match="cannot read weights from a list"):
        analyze([1, 2], AnalyzeConfig(k=2))
