"""Every load route works or refuses loudly (issue 40 §4).

Each route (``AutoModelForCausalLM``, the family's own class, ``pipeline``,
``flowgeom.compress.load``) on a factored Llama and Qwen2 folder, in each import
order (flowgeom before transformers, transformers' Auto modules before flowgeom,
no flowgeom at all), in a fresh interpreter per order: a route either gives the
logits of flowgeom's own loader (to 1e-5) with factored projections, or raises an
exception whose text names ``flowgeom.compress.load``. No route returns a model
whose compressed projections are random. Then ``flowgeom.compress.load`` on every
dense source ``compress run`` reads, and on what is not a model.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from test_share_evaluate import _byte_tokenizer

from flowgeom.errors import FlowgeomError

transformers = pytest.importorskip("transformers")

FAMILIES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
IDS = [[5, 9, 200, 17, 3, 44, 101]]
PROMPT = "In the beginning"
ORDERS = {
    "flowgeom first": "import flowgeom\nimport transformers",
    # the Auto modules already imported when flowgeom is (registered at once), and flowgeom by a submodule only
    "transformers first": "import transformers\nfrom transformers import AutoModelForCausalLM, pipeline\n"
                          "import flowgeom.errors",
    "without flowgeom": "import transformers",
}
LOADED = {"flowgeom first": ("auto", "pipeline", "load"), "transformers first": ("auto", "pipeline", "load"),
          "without flowgeom": ()}
CASES = [(order, route, family) for order in ORDERS for route in ("auto", "class", "pipeline", "load")
         for family in FAMILIES if not (order == "without flowgeom" and route == "load")]

PROBE = r'''
import json, sys
{prologue}
import torch

args = json.loads(sys.argv[1])
ids = torch.tensor(args["ids"])
out = {{}}


def logits(model):
    with torch.no_grad():
        return {{"logits": model(ids).logits.flatten().tolist(),
                "q_proj": type(model.model.layers[0].self_attn.q_proj).__name__}}


def pipe(folder):
    p = transformers.pipeline("text-generation", model=folder)
    return {{**logits(p.model), "text": p(args["prompt"], max_new_tokens=4, do_sample=False)[0]["generated_text"]}}


def own_config(folder, family):
    config = transformers.AutoConfig.for_model(family, **args["base"][family])
    return getattr(transformers, args["classes"][family]).from_pretrained(folder, config=config)


def route(name, family, fn):
    try:
        out[f"{{name}}/{{family}}"] = fn()
    except Exception as exc:
        out[f"{{name}}/{{family}}"] = {{"error": f"{{type(exc).__name__}}: {{exc}}"}}


for family, folder in args["folders"].items():
    cls = getattr(transformers, args["classes"][family])
    route("auto", family, lambda: logits(transformers.AutoModelForCausalLM.from_pretrained(folder)))
    route("class", family, lambda: logits(cls.from_pretrained(folder)))
    route("pipeline", family, lambda: pipe(folder))
    if "flowgeom" in sys.modules:
        import flowgeom.compress
        route("load", family, lambda: logits(flowgeom.compress.load(folder)))
    else:
        route("class with its own config", family, lambda: logits(own_config(folder, family)))
out["flowgeom imported"] = "flowgeom" in sys.modules
print(json.dumps(out))
'''


def _source(root, family: str):
    from flowgeom.hf.tiny import tiny_model

    src = root / family
    tiny_model(family, seed=3, dtype=torch.float32, vocab_size=256).save_pretrained(src)
    _byte_tokenizer().save(str(src / "tokenizer.json"))
    return src


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Per family: (dense HF source folder, factored folder), built once."""
    from flowgeom.compress.run import CompressionConfig, run_compression

    root = tmp_path_factory.mktemp("routes")
    made = {}
    for family in FAMILIES:
        src = _source(root, family)
        run_compression(str(src), root / f"{family}-f", CompressionConfig(method="svd", budget=0.3))
        made[family] = (src, root / f"{family}-f")
    return made


@pytest.fixture(scope="module")
def reference(folders):
    """flowgeom's own loader's logits, per family."""
    from flowgeom.compress import load

    with torch.no_grad():
        return {family: load(folder)(torch.tensor(IDS)).logits for family, (_, folder) in folders.items()}


@pytest.fixture(scope="module")
def routes(folders):
    """Per import order, what each route gave in a fresh interpreter (the three run side by side)."""
    from flowgeom.compress.folder import base_config_json

    base = {}
    for family, (_, folder) in folders.items():
        config = base_config_json(json.loads((folder / "config.json").read_text()))
        base[family] = {k: v for k, v in config.items() if k != "model_type"}
    args = json.dumps({"ids": IDS, "prompt": PROMPT, "classes": FAMILIES, "base": base,
                       "folders": {family: str(folder) for family, (_, folder) in folders.items()}})
    runs = {order: subprocess.Popen([sys.executable, "-c", PROBE.format(prologue=prologue), args],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for order, prologue in ORDERS.items()}
    out = {}
    for order, run in runs.items():
        stdout, stderr = run.communicate(timeout=300)
        assert run.returncode == 0, stderr[-3000:]
        out[order] = json.loads(stdout.strip().splitlines()[-1])
    return out


@pytest.mark.parametrize("order, route, family", CASES, ids=[f"{o}-{r}-{f}".replace(" ", "_") for o, r, f in CASES])
def test_a_route_gives_the_factored_model_or_refuses_naming_the_loader(routes, reference, order, route, family):
    got = routes[order][f"{route}/{family}"]
    if route in LOADED[order]:
        assert "error" not in got, got.get("error")
        logits = torch.tensor(got["logits"]).reshape(reference[family].shape)
        torch.testing.assert_close(logits, reference[family], rtol=0, atol=1e-5)
        assert got["q_proj"] == "FactoredLinear"
        if route == "pipeline":
            assert got["text"].startswith(PROMPT) and len(got["text"]) > len(PROMPT)
    else:
        assert "error" in got, f"{route} loaded a model: {got.get('q_proj')}"
        assert "flowgeom.compress.load" in got["error"], got["error"]


def test_without_flowgeom_nothing_imported_it(routes):
    assert routes["without flowgeom"]["flowgeom imported"] is False
    assert routes["flowgeom first"]["flowgeom imported"] is True


@pytest.mark.parametrize("family", FAMILIES)
def test_a_config_of_ones_own_finds_no_weights_file(routes, family):
    """A config built by hand skips config.json's refusal; the tensors' file name still keeps transformers from
    building the model with random projections (its error cannot name the loader)."""
    got = routes["without flowgeom"][f"class with its own config/{family}"]
    assert got.get("error", "").startswith("OSError") and "no file named model.safetensors" in got["error"], got


def test_importing_flowgeom_imports_neither_torch_nor_transformers():
    code = ("import sys, flowgeom\nbare = [m in sys.modules for m in ('torch', 'transformers')]\n"
            "import flowgeom.compress\nprint(bare + ['transformers' in sys.modules])")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.split() == ["[False,", "False,", "False]"], run.stderr[-2000:]


def test_an_older_factored_folder_still_loads(folders, reference, tmp_path):
    """A folder written before the refusal keys (type flowgeom_factored, tensors in model.safetensors): load and
    the Auto class (registered in this process) read it as before."""
    from flowgeom.compress import load
    from flowgeom.compress.folder import LEGACY_TYPE
    from flowgeom.compress.folder import LEGACY_WEIGHTS, WEIGHTS_NAME

    old = tmp_path / "old"
    shutil.copytree(folders["llama"][1], old)
    (old / WEIGHTS_NAME).rename(old / LEGACY_WEIGHTS)
    config = json.loads((old / "config.json").read_text())
    config.pop("transformers_weights")
    (old / "config.json").write_text(json.dumps({**config, "model_type": LEGACY_TYPE}))
    ids = torch.tensor(IDS)
    with torch.no_grad():
        torch.testing.assert_close(load(old)(ids).logits, reference["llama"], rtol=0, atol=1e-5)
        auto = transformers.AutoModelForCausalLM.from_pretrained(old)
        torch.testing.assert_close(auto(ids).logits, reference["llama"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_load_gives_an_hf_folder_as_transformers_reads_it(folders, family):
    from flowgeom.compress import load

    src, _ = folders[family]
    ids = torch.tensor(IDS)
    with torch.no_grad():
        mine, theirs = load(src), transformers.AutoModelForCausalLM.from_pretrained(src).eval()
        assert type(mine) is type(theirs)
        torch.testing.assert_close(mine(ids).logits, theirs(ids).logits, rtol=0, atol=1e-5)


def test_load_gives_a_gguf_as_flowgeoms_own_reader_does(folders, tmp_path):
    """A Llama GGUF comes back as transformers' LlamaForCausalLM with the logits of flowgeom's own Llama."""
    from flowgeom.compress import load
    from flowgeom.nn.llama import load_llama

    path = _gguf(folders["llama"][0], tmp_path / "tiny.gguf")
    ids = torch.tensor(IDS)
    with torch.no_grad():
        model = load(path)
        assert type(model) is transformers.LlamaForCausalLM
        torch.testing.assert_close(model(ids).logits, load_llama(path)(ids), rtol=1e-5, atol=1e-5)


def _gguf(src, path):
    """The Llama HF folder ``src`` as a float32 GGUF (rows as stored: both readers see the same tensors)."""
    from safetensors.torch import load_file
    from synthetic_checkpoints import gguf_name, write_gguf

    config = json.loads((src / "config.json").read_text())

    def settings(w):
        w.add_uint32("llama.block_count", config["num_hidden_layers"])
        w.add_uint32("llama.embedding_length", config["hidden_size"])
        w.add_uint32("llama.feed_forward_length", config["intermediate_size"])
        w.add_uint32("llama.attention.head_count", config["num_attention_heads"])
        w.add_uint32("llama.attention.head_count_kv", config["num_key_value_heads"])
        w.add_uint32("llama.rope.dimension_count", config["hidden_size"] // config["num_attention_heads"])
        w.add_float32("llama.attention.layer_norm_rms_epsilon", config["rms_norm_eps"])
        w.add_uint32("llama.context_length", 64)
        w.add_uint32("llama.vocab_size", config["vocab_size"])

    tensors = {gguf_name(k): t.float() for k, t in load_file(str(src / "model.safetensors")).items()}
    write_gguf(path, tensors, kv=settings)
    return path


@pytest.mark.parametrize("what", ["missing", "empty folder", "text file", "factored config without its JSON"])
def test_load_refuses_what_is_not_a_model_in_one_line(folders, tmp_path, what):
    from flowgeom.compress import load
    from flowgeom.compress.folder import JSON_NAME

    path = tmp_path / "x"
    if what == "empty folder":
        path.mkdir()
    elif what == "text file":
        path.write_text("not a model")
    elif what == "factored config without its JSON":
        shutil.copytree(folders["qwen2"][1], path)
        (path / JSON_NAME).unlink()
    with pytest.raises(FlowgeomError) as info:
        load(path)
    message = str(info.value)
    assert str(path) in message and len(message.splitlines()) == 1
    if what == "factored config without its JSON":
        assert f"{JSON_NAME} is missing" in message
    else:
        assert "builtin:smollm2" in message and ".gguf" in message


def test_load_gives_the_builtin_model():
    """builtin:smollm2 (a GGUF, 30 blocks): transformers' Llama, dequantised as compress run reads it."""
    from flowgeom.compress import load

    model = load("builtin:smollm2")
    assert type(model) is transformers.LlamaForCausalLM and model.config.num_hidden_layers == 30
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor(IDS)).logits).all()
