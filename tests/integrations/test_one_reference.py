"""One run, one reference: the Trainer callback and ``flowgeom conserve drift`` give the same numbers and verdict.

The run is the one a newcomer tripped on: a real GPT-2 (2 layers, d=32) under the HF Trainer with plain SGD,
lr 1e-2, 40 steps, ``ConservationCallback(every=5)``, checkpoints at 20 and 40.
"""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch

pytest.importorskip("transformers")
from flowgeom.cli import main  # noqa: E402
from flowgeom.errors import FlowgeomError  # noqa: E402
from flowgeom.integrations.checkpoints import checkpoint_drift  # noqa: E402
from flowgeom.integrations.session import REFERENCE_FILE, MonitorSession, read_reference  # noqa: E402
from integrations_data import TokenData  # noqa: E402


@pytest.fixture(scope="module")
def gpt2_run(tmp_path_factory):
    from transformers import Trainer, TrainingArguments

    from flowgeom.hf.tiny import tiny_model
    from flowgeom.integrations import ConservationCallback

    out = tmp_path_factory.mktemp("gpt2-sgd")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tiny_model("gpt2", seed=0, dtype=torch.float32)
    assert (model.config.n_layer, model.config.n_embd) == (2, 32)
    args = TrainingArguments(output_dir=str(out), max_steps=40, per_device_train_batch_size=4, optim="sgd",
                             learning_rate=1e-2, save_steps=20, report_to=[], use_cpu=True, disable_tqdm=True,
                             dataloader_num_workers=0, seed=0)
    cb = ConservationCallback(every=5)
    Trainer(model=model, args=args, train_dataset=TokenData(n=256), callbacks=[cb]).train()
    return out, cb


def test_drift_measures_from_the_callbacks_theta0_and_agrees(gpt2_run):
    out, cb = gpt2_run
    assert (out / REFERENCE_FILE).is_file()
    history = {h["step"]: h for h in cb.session.history}
    paths = sorted(str(p) for p in out.glob("checkpoint-*"))
    result = checkpoint_drift(paths)
    assert result["reference"]["kind"] == "theta0" and result["reference"]["step"] == 0
    assert result["steps"] == [20, 40]
    for rec in result["records"]:
        ours = history[rec["step"]]
        keys = [k for k in ours if k.startswith(("eps/", "control/", "pred/", "pred_err/", "pred_excess/"))]
        assert any(k.startswith("pred/") for k in keys)
        for key in keys:
            assert rec[key] == pytest.approx(ours[key], rel=1e-12, abs=1e-300), key
    # one verdict: the same families, the same words
    assert result["summary"]["verdicts"] == cb.summary["verdicts"]
    assert result["summary"]["line"] == cb.summary["line"]
    assert {v["verdict"] for v in cb.summary["verdicts"]} == {"held"}
    assert "as expected (discretisation drift" in cb.summary["line"] and "NOT" not in cb.summary["line"]
    # the attention V/O law drifts (the O(τ²k) term), and that drift is the predicted one
    vo = next(v for v in cb.summary["verdicts"] if v["family"] == "attn.vo")
    assert vo["eps"] > 1e-6 and vo["predicted"] == pytest.approx(vo["eps"], rel=1e-2) and vo["excess"] < 1


def test_one_checkpoint_is_enough_with_theta0(gpt2_run, tmp_path):
    out, cb = gpt2_run
    result = checkpoint_drift([out / "checkpoint-40"])
    assert result["steps"] == [40] and result["summary"]["line"] == cb.summary["line"]
    shutil.copytree(out / "checkpoint-40", tmp_path / "checkpoint-40")
    with pytest.raises(FlowgeomError, match="at least 2 checkpoints"):
        checkpoint_drift([tmp_path / "checkpoint-40"])


def test_the_cli_prints_the_callbacks_line(gpt2_run, capsys):
    out, cb = gpt2_run
    paths = [str(p) for p in sorted(out.glob("checkpoint-*"))]
    assert main(["conserve", "drift", *paths, "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["summary"]["line"] == cb.summary["line"]
    assert main(["conserve", "drift", *paths]) == 0
    text = capsys.readouterr().out
    assert "against θ_0" in text and cb.summary["line"] in text.replace("\n", "")


def test_without_theta0_the_reference_is_named(gpt2_run, tmp_path):
    out, cb = gpt2_run
    for p in out.glob("checkpoint-*"):
        shutil.copytree(p, tmp_path / p.name)
    paths = sorted(str(p) for p in tmp_path.glob("checkpoint-*"))
    result = checkpoint_drift(paths)
    assert result["reference"] == {"kind": "checkpoint", "path": paths[0], "step": 20}
    assert "step 40 (from checkpoint-20; θ_0 unknown)" in result["summary"]["line"]
    assert result["records"][0]["eps/attn.vo"] == 0.0  # checkpoint-20 against itself
    last = result["records"][1]
    assert last["eps/attn.vo"] != pytest.approx(cb.session.history[-1]["eps/attn.vo"])
    # the callback's prediction over the steps between the two checkpoints (ĥ_40 − ĥ_20) still decides
    assert last["pred/attn.vo"] == pytest.approx(last["eps/attn.vo"], rel=1e-2) and last["pred_excess/attn.vo"] < 1
    assert "as expected (discretisation drift" in result["summary"]["line"]
    # the θ_0 file named explicitly gives the callback's numbers again
    again = checkpoint_drift(paths, reference=out / REFERENCE_FILE)
    assert again["summary"]["line"] == cb.summary["line"]
    # without the callback's states either: the ratio heuristic, and the line says it is one
    for p in tmp_path.glob("checkpoint-*/flowgeom_monitor.safetensors"):
        p.unlink()
    bare = checkpoint_drift(paths, optimizer_kind="sgd")
    assert not any(k.startswith("pred") for k in bare["records"][1])
    assert "(from checkpoint-20; θ_0 unknown)" in bare["summary"]["line"] and "heuristic" in bare["summary"]["line"]


def test_a_theta0_of_another_model_is_not_used_and_said(gpt2_run, tmp_path, tiny_llama):
    out, _ = gpt2_run
    for p in out.glob("checkpoint-*"):
        shutil.copytree(p, tmp_path / p.name)
    model = tiny_llama()
    MonitorSession(model, torch.optim.SGD(model.parameters(), lr=0.1)).save_reference(tmp_path)
    assert read_reference(tmp_path / REFERENCE_FILE)["step"] == 0
    result = checkpoint_drift(sorted(str(p) for p in tmp_path.glob("checkpoint-*")))
    assert result["reference"]["kind"] == "checkpoint"
    assert f"θ_0 unknown ({REFERENCE_FILE} was saved for another model)" in result["summary"]["line"]


def test_a_damaged_theta0_is_one_error(gpt2_run, tmp_path, capsys):
    out, _ = gpt2_run
    for p in out.glob("checkpoint-*"):
        shutil.copytree(p, tmp_path / p.name)
    (tmp_path / REFERENCE_FILE).write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    paths = sorted(str(p) for p in tmp_path.glob("checkpoint-*"))
    with pytest.raises(FlowgeomError, match="flowgeom"):
        checkpoint_drift(paths)
    assert main(["conserve", "drift", *paths]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and REFERENCE_FILE in err[0]
    assert main(["conserve", "drift", *paths, "--reference", str(tmp_path / "nope")]) == 2
    assert "--reference" in capsys.readouterr().err
