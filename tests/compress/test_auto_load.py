"""A factored folder loads correctly through transformers' Auto classes once flowgeom is imported, and fails
loudly without it (an error naming flowgeom.compress.load): never as a Llama with random projections. Every route
in every import order: test_load_routes.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from test_compression import _share, tiny  # noqa: F401 - the tiny HF Llama folder fixture

from flowgeom.compress.folder import factored_llama

transformers = pytest.importorskip("transformers")

IDS = [[5, 9, 200, 17, 3, 44, 101]]


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


@pytest.fixture
def factored(capsys, tiny, tmp_path):  # noqa: F811
    out = tmp_path / "w"
    code, _, err = _share(capsys, tiny, out, "--method", "whiten", "--budget", "0.3", "--allocate", "even")
    assert code == 0, err
    return out


def test_a_factored_folder_names_its_own_model_type(factored):
    from flowgeom.compress.folder import FACTORED_TYPE, REFUSAL
    from flowgeom.compress.folder import WEIGHTS_NAME

    cfg = json.loads((factored / "config.json").read_text())
    assert cfg["model_type"] == FACTORED_TYPE and cfg["flowgeom_base_model_type"] == "llama"
    assert cfg["architectures"] == ["FlowgeomFactoredForCausalLM"] and cfg["transformers_weights"] == REFUSAL
    assert (factored / WEIGHTS_NAME).is_file() and not (factored / "model.safetensors").exists()


def test_without_flowgeom_transformers_refuses_the_folder(factored):
    run = _python(f"import transformers\ntransformers.AutoModelForCausalLM.from_pretrained({str(factored)!r})")
    assert run.returncode != 0
    assert "flowgeom.compress.load" in run.stderr and "ValueError" in run.stderr, run.stderr[-2000:]


def test_with_flowgeom_imported_auto_classes_load_the_factored_model(factored):
    with torch.no_grad():
        want = factored_llama(factored)(torch.tensor(IDS))
    code = (f"import torch, transformers, flowgeom.compress\n"
            f"m = transformers.AutoModelForCausalLM.from_pretrained({str(factored)!r}).eval()\n"
            f"with torch.no_grad():\n    print(m(torch.tensor({IDS})).logits.flatten().tolist())\n"
            f"print(type(m.model.layers[0].self_attn.q_proj).__name__)")
    run = _python(code)
    assert run.returncode == 0, run.stderr[-2000:]
    values, kind = run.stdout.strip().splitlines()
    got = torch.tensor(json.loads(values)).reshape(want.shape)
    assert (got - want).abs().max() < 1e-5 and kind == "FactoredLinear"


def test_compress_load_gives_the_factored_and_the_dropped_models(factored, capsys, tiny, tmp_path):  # noqa: F811
    from flowgeom.compress import load

    ids = torch.tensor(IDS)
    with torch.no_grad():
        assert (load(factored)(ids).logits - factored_llama(factored)(ids)).abs().max() < 1e-5
        out = tmp_path / "dropped"
        code, _, err = _share(capsys, tiny, out, "--method", "drop-angular", "--budget", "0.25")
        assert code == 0, err
        model = load(out)
        assert type(model).__name__ == "LlamaForCausalLM" and model(ids).logits.shape[-1] == 256
    assert model.generate(ids, max_new_tokens=3, do_sample=False).shape == (1, 10)


def test_a_loaded_factored_model_refuses_save_pretrained(factored, tmp_path):
    """transformers' save_pretrained of a factored model would write a folder plain transformers loads with
    random projections: refused on the instance, naming the ways that keep the factors."""
    from flowgeom.compress import load
    from flowgeom.errors import FlowgeomError

    model = load(factored)
    with pytest.raises(FlowgeomError, match="random projections.*--dense"):
        model.save_pretrained(tmp_path / "resaved")
    assert not (tmp_path / "resaved").exists()
