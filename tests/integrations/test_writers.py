"""The plain-loop writers, each read back for real: CSV, TensorBoard's own reader, the offline W&B run file."""

from __future__ import annotations

import math

import pytest
import torch

from flowgeom.errors import FlowgeomError
from flowgeom.integrations.writers import CSVWriter, TensorBoardWriter, read_csv, scalars, tag
from flowgeom.laws.monitor import ConservationMonitor
from flowgeom.nn import SwiGLU


def _records(steps=4):
    """Records of a real monitor on a zoo SwiGLU trained by SGD, measured right after each opt.step()."""
    g = torch.Generator().manual_seed(0)
    model = SwiGLU(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = ConservationMonitor(model, optimizer=opt, warn=False)
    out = []
    for k in range(steps):
        x = torch.randn(8, 4, generator=g)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        out.append(mon.step(k + 1))
    return out


def test_tag_and_scalars_filter_non_floats():
    assert tag("eps/attn.qk_rope@model.layers.0.self_attn") == "flowgeom/eps/attn.qk_rope/model.layers.0.self_attn"
    rec = {"step": 3, "eps/a": 0.5, "eps/a@b": 0.25, "uncovered": [{"block": "x"}], "ok": True, "bad": math.nan}
    assert scalars(rec) == {"eps/a": 0.5, "eps/a@b": 0.25}
    assert scalars(rec, per_block=False) == {"eps/a": 0.5}
    assert scalars(None) == {}


def test_csv_round_trip_and_append(tmp_path):
    recs = _records()
    path = tmp_path / "m.csv"
    with CSVWriter(path) as w:
        for r in recs[:2]:
            w.write(r)
        w.write(None)  # a step that was not due
    with CSVWriter(path) as w:  # a resumed run appends, without a second header
        for r in recs[2:]:
            w.write(r)
    back = read_csv(path)
    assert sorted(back) == [1, 2, 3, 4]
    for r in recs:
        assert back[r["step"]] == scalars(r)
    assert path.read_text().count("step,key,value") == 1


def test_tensorboard_read_back_with_tensorboards_reader(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    recs = _records()
    with TensorBoardWriter(tmp_path / "tb") as w:
        for r in recs:
            w.write(r)
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    want = {tag(k) for k in scalars(recs[0])}
    assert tags == want and "flowgeom/eps/swiglu.up_down" in tags
    for r in recs:
        for k, v in scalars(r).items():
            (ev,) = [e for e in acc.Scalars(tag(k)) if e.step == r["step"]]
            assert ev.value == pytest.approx(v, rel=1e-6)  # TensorBoard stores float32


def test_wandb_offline_run_read_back(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from wandb_offline import read_history

    from flowgeom.integrations.writers import WandbWriter

    monkeypatch.setenv("WANDB_MODE", "offline")
    recs = _records(3)
    w = WandbWriter(tmp_path / "wb", name="t")
    for r in recs:
        w.write(r)
    run_dir = w.run_dir
    w.close()
    assert run_dir.name.startswith("offline-run-")
    rows = read_history(run_dir)
    assert [row["_step"] for row in rows] == [1, 2, 3]
    for row, r in zip(rows, recs):
        assert {k: v for k, v in row.items() if k.startswith("flowgeom/")} == {tag(k): v for k, v in scalars(r).items()}


def test_unwritable_logging_dir_is_one_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(FlowgeomError, match="cannot be written.*pass a writable folder"):
        CSVWriter(blocker / "sub" / "m.csv")
    with pytest.raises(FlowgeomError, match="is a folder"):
        CSVWriter(tmp_path)
    pytest.importorskip("tensorboard")
    with pytest.raises(FlowgeomError, match="TensorBoard log_dir .* cannot be written"):
        TensorBoardWriter(blocker / "tb")
    with pytest.raises(FlowgeomError, match="integer step"):
        CSVWriter(tmp_path / "x.csv").write({"eps/a": 1.0})
