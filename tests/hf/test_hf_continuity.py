"""`continuity analyze` on real transformers / PEFT models: planted structure inside fused and wrapped projections.

Each family: a tiny random model (flowgeom.hf.tiny) with 5 layers; one role is
overwritten so that its layers share a top singular vector (v1, or u1 for a
down projection), written into the tensor through the test's own view of the
layout (``split`` / ``view``), independent of the analyzer's row ranges. The
analyzer must find |cos| ~ 1 there and chance (ratio to its own random
baseline < 3, verdict "neither") for the roles that share the same fused
tensor, so a wrong split fails. Both in memory and on disk (save_pretrained,
safetensors + config.json), and every tensor is accounted for.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from flowgeom.cli import main  # noqa: E402
from flowgeom.continuity import AnalyzeConfig, analyze  # noqa: E402
from flowgeom.hf.tiny import tiny_model  # noqa: E402

L, H, KV, HD, D = 5, 4, 2, 8, 32  # layers, heads, K/V heads, head_dim, hidden (tiny.py's sizes)


def planted(m: int, n: int, *, shared: str, seed: int) -> list[torch.Tensor]:
    """L matrices ``noise + 10 u_l v_l^T`` sharing v (``shared="in"``) or u ("out") across layers."""
    g = torch.Generator().manual_seed(seed)
    unit = lambda k: torch.nn.functional.normalize(torch.randn(k, generator=g, dtype=torch.float64), dim=0)  # noqa: E731
    u0, v0 = unit(m), unit(n)
    return [torch.randn(m, n, generator=g, dtype=torch.float64) / (math.sqrt(m) + math.sqrt(n))
            + 10 * torch.outer(u0 if shared == "out" else unit(m), v0 if shared == "in" else unit(n))
            for _ in range(L)]


def layers(model):
    base = getattr(model, "model", None) or getattr(model, "transformer", None) or model.gpt_neox
    return base.layers if hasattr(base, "layers") else base.h


def report_of(source, **kw) -> dict:
    return analyze(source, AnalyzeConfig(k=2, batch=L, **kw))  # all layers in one batched call: fast on tiny models


def check(report: dict, hot: str, cold: tuple[str, ...], space: str = "in") -> None:
    """``hot`` continuous in ``space`` with |cos| ~ 1; every ``cold`` role at chance."""
    r = report["roles"][hot]
    assert r[f"{'v1' if space == 'in' else 'u1'}"] > 0.99, (hot, r["v1"], r["u1"])
    assert r["verdict"].startswith("input" if space == "in" else "output"), r["verdict"]
    for role in cold:
        c = report["roles"][role]
        assert c["v1_ratio"] < 3 and c["u1_ratio"] < 3 and c["verdict"] == "neither", (role, c["v1_ratio"], c["u1_ratio"])


def accounted(report: dict, names) -> None:
    """Every tensor is a role's, a LoRA tensor, or unmatched with a reason; no 2-D tensor lacks a pattern."""
    used = {t for r in report["roles"].values() for t in r["tensors"]}
    lora = {e[x] for e in report["lora"] for x in ("A", "B") if e[x]}
    unmatched = {u["tensor"]: u["reason"] for u in report["unmatched"]}
    assert used | lora | set(unmatched) == set(names)
    assert not used & set(unmatched)
    assert all(reason in ("1-D (norm/bias)", "embedding / LM head") for reason in unmatched.values()), unmatched


def on_disk(model, tmp_path):
    model.save_pretrained(tmp_path, safe_serialization=True)
    names = []
    for f in tmp_path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            names += list(h.keys())
    return tmp_path, names


# ------------------------------------------------------------------ families with plain q/k/v/o


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma"])
def test_plain_attention_families(family, tmp_path):
    model = tiny_model(family, seed=0, dtype=torch.float32, num_hidden_layers=L)
    with torch.no_grad():
        for layer, w in zip(layers(model), planted(KV * HD, D, shared="in", seed=1)):
            layer.self_attn.k_proj.weight.copy_(w)
    rep = report_of(model)
    assert rep["scheme"] == "llama" and rep["warnings"] == []
    check(rep, "k", ("q", "v", "o", "gate", "up"))
    accounted(rep, model.state_dict())
    folder, names = on_disk(model, tmp_path)
    disk = report_of(folder)
    check(disk, "k", ("q", "v"))
    accounted(disk, names)
    assert disk["roles"]["k"]["v1"] == pytest.approx(rep["roles"]["k"]["v1"], abs=1e-6)


def test_bert(tmp_path):
    model = tiny_model("bert", seed=0, dtype=torch.float32, num_hidden_layers=L)
    with torch.no_grad():
        for layer, w in zip(model.bert.encoder.layer, planted(D, D, shared="in", seed=2)):
            layer.attention.self.key.weight.copy_(w)
    rep = report_of(on_disk(model, tmp_path)[0])
    assert rep["scheme"] == "bert"
    check(rep, "k", ("q", "v", "o"))


def test_gpt2_conv1d_thirds(tmp_path):
    model = tiny_model("gpt2", seed=0, dtype=torch.float32, n_layer=L)
    with torch.no_grad():
        for block, w in zip(model.transformer.h, planted(D, D, shared="in", seed=3)):
            block.attn.c_attn.weight.split(D, dim=1)[2].copy_(w.T)  # Conv1D (in, 3 out): v = last third
    folder, names = on_disk(model, tmp_path)
    rep = report_of(folder)
    assert rep["scheme"] == "gpt2"
    check(rep, "v", ("q", "k"))
    accounted(rep, names)


# ------------------------------------------------------------------ fused q|k|v


def test_phi3_fused_qkv_and_gate_up(tmp_path, capsys):
    model = tiny_model("phi3", seed=0, dtype=torch.float32, num_hidden_layers=L)
    ks, ups = planted(KV * HD, D, shared="in", seed=4), planted(64, D, shared="in", seed=5)
    with torch.no_grad():
        for layer, k, up in zip(layers(model), ks, ups):
            layer.self_attn.qkv_proj.weight.split([H * HD, KV * HD, KV * HD])[1].copy_(k)  # rows q | k | v
            layer.mlp.gate_up_proj.weight.chunk(2)[1].copy_(up)  # rows gate | up
    rep = report_of(model)
    check(rep, "k", ("q", "v"))
    check(rep, "up", ("gate",))
    assert rep["roles"]["k"]["shape"] == [KV * HD, D] and rep["roles"]["q"]["shape"] == [H * HD, D]
    folder, names = on_disk(model, tmp_path)
    disk = report_of(folder)  # head counts from config.json
    check(disk, "k", ("q", "v"))
    accounted(disk, names)
    # without config.json the q|k|v split is ambiguous: refused with a reason and a warning, the rest analysed
    (folder / "config.json").unlink()
    assert main(["continuity", "analyze", str(folder), "--json", "--k", "2"]) == 0
    captured = capsys.readouterr()
    blind = json.loads(captured.out)
    assert "q" not in blind["roles"] and "up" in blind["roles"] and "o" in blind["roles"]
    assert "attention roles q, k, v not found" in captured.err and "--heads" in captured.err
    assert "Traceback" not in captured.err
    qkv = [u for u in blind["unmatched"] if u["tensor"].endswith("qkv_proj.weight")]
    assert len(qkv) == L and all("--heads" in u["reason"] for u in qkv)
    assert main(["continuity", "analyze", str(folder), "--json", "--k", "2", "--heads", "4", "--kv-heads", "2"]) == 0
    flagged = json.loads(capsys.readouterr().out)
    check(flagged, "k", ("q", "v"))
    # a wrong head count that does not fit the rows is refused, not guessed
    assert main(["continuity", "analyze", str(folder), "--json", "--k", "2", "--heads", "5", "--kv-heads", "2"]) == 0
    assert "do not fit" in capsys.readouterr().err


def test_gpt_neox_interleaved(tmp_path):
    model = tiny_model("gpt_neox", seed=0, dtype=torch.float32, num_hidden_layers=L)
    with torch.no_grad():
        for layer, k in zip(model.gpt_neox.layers, planted(D, D, shared="in", seed=6)):
            w = layer.attention.query_key_value.weight  # (3 D, D) viewed as (H, 3, hd, D)
            w.view(H, 3, HD, D)[:, 1].copy_(k.view(H, HD, D))
    folder, names = on_disk(model, tmp_path)
    for source in (model, folder):
        rep = report_of(source)
        assert rep["scheme"] == "gpt_neox"
        check(rep, "k", ("q", "v"))
    accounted(rep, names)


@pytest.mark.parametrize("variant", ["multi_query", "new_decoder", "multi_head"])
def test_falcon_layouts(variant, tmp_path):
    over = {"multi_query": {}, "new_decoder": dict(new_decoder_architecture=True, num_kv_heads=KV),
            "multi_head": dict(multi_query=False)}[variant]
    kv = {"multi_query": 1, "new_decoder": KV, "multi_head": H}[variant]
    model = tiny_model("falcon", seed=0, dtype=torch.float32, num_hidden_layers=L, **over)
    with torch.no_grad():
        for block, k in zip(model.transformer.h, planted(kv * HD, D, shared="in", seed=7)):
            w = block.self_attention.query_key_value.weight  # rows (KV, H/KV + 2, hd)
            w.view(kv, H // kv + 2, HD, D)[:, -2].copy_(k.view(kv, HD, D))
    folder, names = on_disk(model, tmp_path)
    rep = report_of(folder)
    assert rep["scheme"] == "falcon" and rep["roles"]["k"]["shape"] == [kv * HD, D]
    check(rep, "k", ("q", "v"))
    accounted(rep, names)


def test_row_layouts_agree_with_the_family_table():
    """The naming's row ranges equal flowgeom.hf.families.fused_rows for every fused attention layout."""
    from flowgeom.continuity.layouts import NamingHints, qkv_rows
    from flowgeom.hf.families import family, fused_rows
    from flowgeom.hf.tiny import tiny_config

    cases = [("phi3", "self_attn.qkv_proj", "blocked", {}, KV), ("gpt_neox", "attention.query_key_value", "interleaved", {}, H),
             ("falcon", "self_attention.query_key_value", "grouped", {}, 1),
             ("falcon", "self_attention.query_key_value", "grouped", dict(new_decoder_architecture=True, num_kv_heads=KV), KV),
             ("falcon", "self_attention.query_key_value", "grouped", dict(multi_query=False), H)]
    for model_type, path, layout, over, kv in cases:
        config = tiny_config(model_type, **over)
        size = (H + 2 * kv) * HD
        want = fused_rows(family(model_type).fused[path], config, family(model_type), size)
        hints = NamingHints(config=config.to_dict())
        for part in "qkv":
            got = torch.cat([torch.arange(a, b) for a, b in qkv_rows(layout, part, size, hints)])
            assert torch.equal(got, want[part]), (model_type, over, part)


# ------------------------------------------------------------------ mixture of experts


def test_mixtral_fused_in_memory_per_expert_on_disk(tmp_path):
    model = tiny_model("mixtral", seed=0, dtype=torch.float32, num_hidden_layers=L)
    m = model.config.intermediate_size
    with torch.no_grad():
        for layer, up, r in zip(layers(model), planted(m, D, shared="in", seed=8), planted(4, D, shared="in", seed=9)):
            layer.mlp.experts.gate_up_proj[1].chunk(2)[1].copy_(up)  # (E, 2m, d): expert 1, rows gate | up
            layer.mlp.gate.weight.copy_(r)  # router (E, d)
    rep = report_of(model)
    assert {"router", "expert0.gate", "expert3.down"} <= set(rep["roles"]) and rep["warnings"] == []
    check(rep, "expert1.up", ("expert1.gate", "expert0.up", "expert2.up", "expert1.down"))
    assert rep["roles"]["router"]["v1"] > 0.99 and rep["roles"]["router"]["k"] == 2
    accounted(rep, model.state_dict())
    folder, names = on_disk(model, tmp_path)  # transformers writes block_sparse_moe.experts.N.w1/w2/w3 + gate
    assert any(".block_sparse_moe.experts.1.w3.weight" in n for n in names)
    disk = report_of(folder)
    check(disk, "expert1.up", ("expert1.gate", "expert0.up"))
    assert disk["roles"]["expert1.up"]["tensors"][0].endswith("block_sparse_moe.experts.1.w3.weight")
    assert disk["roles"]["router"]["v1"] > 0.99
    accounted(disk, names)
    # the fused 3-D stacks on disk, sliced one expert at a time
    fused = tmp_path / "fused"
    fused.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, fused / "model.safetensors")
    raw = report_of(fused, roles=("expert1.up", "expert1.gate", "expert1.down"))
    assert raw["roles"]["expert1.up"]["v1"] == pytest.approx(rep["roles"]["expert1.up"]["v1"], abs=1e-6)
    check(raw, "expert1.up", ("expert1.gate",))
    assert any(u["reason"] == "role q not selected (--roles)" for u in raw["unmatched"])
    assert not any("experts" in u["tensor"] for u in raw["unmatched"])  # the stacks are used (expert 1's slices)


@pytest.mark.parametrize("family", ["qwen2_moe", "olmoe"])
def test_qwen2_moe_and_olmoe(family, tmp_path):
    model = tiny_model(family, seed=0, dtype=torch.float32, num_hidden_layers=L)
    d_out = planted(D, model.config.moe_intermediate_size if family == "qwen2_moe" else model.config.intermediate_size,
                    shared="out", seed=10)
    with torch.no_grad():
        for layer, w in zip(layers(model), d_out):
            layer.mlp.experts.down_proj[2].copy_(w)  # (E, d, m): expert 2's down, shared output direction
    rep = report_of(model)
    check(rep, "expert2.down", ("expert1.down", "expert2.up", "expert2.gate"), space="out")
    if family == "qwen2_moe":
        assert {"shared.gate", "shared.up", "shared.down", "shared.router"} <= set(rep["roles"])
        assert rep["roles"]["shared.router"]["shape"] == [1, D] and rep["roles"]["shared.router"]["k"] == 1
    folder, names = on_disk(model, tmp_path)
    disk = report_of(folder)
    check(disk, "expert2.down", ("expert1.down", "expert2.up"), space="out")
    assert set(disk["roles"]) == set(rep["roles"])
    accounted(disk, names)


# ------------------------------------------------------------------ PEFT LoRA


def _peft_llama(rslora: bool = False):
    peft = pytest.importorskip("peft")
    model = tiny_model("llama", seed=0, dtype=torch.float32, num_hidden_layers=L)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_rslora=rslora)
    pm = peft.get_peft_model(model, config)
    g = torch.Generator().manual_seed(11)
    v0 = torch.nn.functional.normalize(torch.randn(D, generator=g), dim=0)
    with torch.no_grad():  # s·B A = 6 u_l v0^T in q: only the adapted weight is continuous
        for layer in layers(pm.base_model.model):
            q = layer.self_attn.q_proj
            s = q.scaling["default"]
            q.lora_A["default"].weight.zero_()[0].copy_(6 * v0 / s)
            q.lora_B["default"].weight.zero_()[:, 0].copy_(torch.nn.functional.normalize(torch.randn(H * HD, generator=g), dim=0))
    return model, pm


def test_peft_lora_in_memory_and_on_disk(tmp_path, capsys):
    model, pm = _peft_llama()
    base = report_of(pm)
    assert "q" in base["roles"] and base["roles"]["q"]["tensors"][0].endswith("q_proj.base_layer.weight")
    assert base["roles"]["q"]["verdict"] == "neither"  # the frozen base is random
    assert len(base["lora"]) == 2 * L and not any(e["merged"] for e in base["lora"])
    accounted(base, pm.state_dict())
    merged = report_of(pm, merge_lora=True)
    check(merged, "q", ("v", "k"))
    assert merged["roles"]["q"]["merged_lora"] == L and all(e["scale"] == 2.0 for e in merged["lora"])
    # on disk: the base model and the adapter saved into one folder
    model.save_pretrained(tmp_path)  # PEFT leaves the base weights in place (unmerged)
    pm.save_pretrained(tmp_path)
    assert main(["continuity", "analyze", str(tmp_path), "--k", "2"]) == 0
    table = capsys.readouterr().out
    assert "pass --merge-lora" in table and "not analysed" in table
    assert main(["continuity", "analyze", str(tmp_path), "--k", "2", "--json", "--merge-lora"]) == 0
    disk = json.loads(capsys.readouterr().out)
    check(disk, "q", ("v", "k"))
    assert disk["roles"]["q"]["v1"] == pytest.approx(merged["roles"]["q"]["v1"], abs=1e-6)
    # no adapter_config.json: the scale is unknown, refused in one line
    (tmp_path / "adapter_config.json").unlink()
    assert main(["continuity", "analyze", str(tmp_path), "--merge-lora"]) == 2
    err = capsys.readouterr().err
    assert "adapter_config.json" in err and err.count("\n") == 1


def test_an_adapter_folder_alone_says_where_the_base_weights_go(tmp_path, capsys):
    _, pm = _peft_llama()
    pm.save_pretrained(tmp_path)  # adapter_model.safetensors + adapter_config.json, no base weights
    assert main(["continuity", "analyze", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "only PEFT LoRA factors" in err and "--merge-lora" in err and err.count("\n") == 1


def test_rank_and_alpha_patterns_give_peft_scales_and_a_foreign_config_is_refused(tmp_path, capsys):
    peft = pytest.importorskip("peft")
    model = tiny_model("llama", seed=0, dtype=torch.float32, num_hidden_layers=L)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], rank_pattern={"v_proj": 2},
                             alpha_pattern={"q_proj": 12}, init_lora_weights=False)
    pm = peft.get_peft_model(model, config)
    model.save_pretrained(tmp_path)
    pm.save_pretrained(tmp_path)
    disk = report_of(tmp_path, merge_lora=True)
    want = {name.removeprefix("base_model.model."): float(m.scaling["default"])
            for name, m in pm.named_modules() if hasattr(m, "lora_A") and isinstance(getattr(m, "scaling", None), dict)}
    got = {e["module"]: e["scale"] for e in disk["lora"]}
    assert got == pytest.approx(want) and {round(v, 6) for v in got.values()} == {3.0, 4.0}  # 12/4 (q), 8/2 (v)
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    cfg["rank_pattern"] = {}  # the v adapters have rank 2, the config now says 4: not this adapter's config
    (tmp_path / "adapter_config.json").write_text(json.dumps(cfg))
    capsys.readouterr()  # drop transformers' save progress bars
    assert main(["continuity", "analyze", str(tmp_path), "--merge-lora"]) == 2
    err = capsys.readouterr().err
    assert "says r = 4" in err and "have rank 2" in err and err.count("\n") == 1


def test_rslora_scale_matches_peft(tmp_path):
    model, pm = _peft_llama(rslora=True)
    pm.save_pretrained(tmp_path)
    model.save_pretrained(tmp_path)
    disk = report_of(tmp_path, merge_lora=True)
    assert [e["scale"] for e in disk["lora"]] == pytest.approx([8 / math.sqrt(4)] * len(disk["lora"]))
    assert disk["lora"][0]["scale"] == pytest.approx(pm.base_model.model.model.layers[0].self_attn.q_proj.scaling["default"])
    check(disk, "q", ("v",))


def test_qwen2_moe_with_dense_layers_names_experts_and_dense_mlps(tmp_path):
    """A real Qwen2-MoE with mlp_only_layers: sparse layers 0-1 give experts, dense layers 2-3 gate/up/down."""
    model = tiny_model("qwen2_moe", seed=0, dtype=torch.float32, num_hidden_layers=4, mlp_only_layers=[2, 3])
    folder, names = on_disk(model, tmp_path)
    rep = report_of(folder)
    assert rep["scheme"] == "qwen2_moe"
    assert {"gate", "up", "down", "router", "expert0.down", "shared.up"} <= set(rep["roles"])
    assert rep["roles"]["gate"]["tensors"] == [f"model.layers.{i}.mlp.gate_proj.weight" for i in (2, 3)]
    accounted(rep, names)
