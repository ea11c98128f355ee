"""Run folders from someone else: resume never unpickles, tampered results are redone, JSON is strict.

The hostile inputs are real files: a pickle whose ``__reduce__`` creates a
marker file (checked to be live with ``torch.load(weights_only=False)``),
checkpoints truncated or with flipped bytes, and finished sweep runs whose
``summary.json`` / ``metrics.jsonl`` / manifest were edited afterwards.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flowgeom.errors import FlowgeomError
from flowgeom.langevin import Langevin
from flowgeom.runs import RunFolder, decode_checkpoint, encode_checkpoint, to_json

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "experiments"))
import _sweep_fakes as fakes  # noqa: E402  (the fake claims of the sweep tests)

from flowgeom.reproduce.pipeline import reproduce  # noqa: E402
from flowgeom.reproduce.sweep import plan, run_sweep  # noqa: E402


# ---------------------------------------------------------------- helpers

class Planted:
    """Unpickling this object opens (creates) ``marker``: code run by the loader."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def plant_pickle(path: Path, marker: Path) -> None:
    torch.save({"step": 1, "evil": Planted(marker)}, path)


def strict_loads(text: str):
    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")
    return json.loads(text, parse_constant=refuse)


def same(a, b) -> bool:
    """Exact equality, including types (int vs float vs bool, tuple vs list) and tensor dtype/shape/bits."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.dtype == torch.bool
                                                                          else a, b.view(torch.uint8)
                                                                          if b.dtype == torch.bool else b) \
            if a.numel() else a.dtype == b.dtype and a.shape == b.shape
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return a == b


# ---------------------------------------------------------------- 1. no code execution on resume

def test_the_planted_pickle_is_live(tmp_path):
    """Control: the planted file really runs code when unpickled (so the tests below can fail)."""
    marker = tmp_path / "pwned"
    plant_pickle(tmp_path / "x.pt", marker)
    torch.load(tmp_path / "x.pt", weights_only=False)
    assert marker.exists()


def test_old_pickle_checkpoint_is_refused_never_unpickled(tmp_path):
    marker = tmp_path / "pwned"
    run = RunFolder(tmp_path / "run")
    run.start({"n": 1}, resume=False)
    plant_pickle(run.path / "checkpoint.pt", marker)
    with pytest.raises(FlowgeomError, match="old pickle format.*execute code.*delete it") as err:
        run.load_checkpoint()
    assert str(run.path / "checkpoint.pt") in str(err.value)
    assert not marker.exists()


def test_a_pickle_renamed_to_the_new_name_is_corrupt_not_run(tmp_path):
    marker = tmp_path / "pwned"
    run = RunFolder(tmp_path / "run")
    plant_pickle(tmp_path / "run.pt", marker)
    run.path.mkdir()
    (run.path / RunFolder.CHECKPOINT).write_bytes((tmp_path / "run.pt").read_bytes())
    with pytest.raises(FlowgeomError, match="corrupt or truncated"):
        run.load_checkpoint()
    assert not marker.exists()


@pytest.mark.slow
def test_real_trainer_resume_refuses_the_planted_pickle(tmp_path):
    """A conservation run killed mid-way, its checkpoint replaced by a planted pickle: resume refuses it."""
    from flowgeom.experiments.conservation import ConservationConfig, run_conservation

    tiny = dict(d_model=8, heads=2, d_k=4, d_hidden=8, n_layers=1, seq_len=8, batch=4, corpus_chars=5000,
                n_train=64, steps=8, log_every=2, checkpoint_every=4)
    cfg = ConservationConfig.for_arch("mha-sinusoidal-swiglu", **tiny, lr=0.1)
    assert run_conservation(cfg, tmp_path / "r", stop_after=5) is None
    folder = tmp_path / "r"
    good = (folder / RunFolder.CHECKPOINT).read_bytes()
    (folder / RunFolder.CHECKPOINT).unlink()
    marker = tmp_path / "pwned"
    plant_pickle(folder / "checkpoint.pt", marker)
    with pytest.raises(FlowgeomError, match="old pickle format"):
        run_conservation(cfg, folder, resume=True)
    assert not marker.exists() and not RunFolder(folder).finished
    # A truncated new-format checkpoint is a clear error too, not a traceback from safetensors.
    (folder / "checkpoint.pt").unlink()
    (folder / RunFolder.CHECKPOINT).write_bytes(good[: len(good) // 2])
    with pytest.raises(FlowgeomError, match="corrupt or truncated"):
        run_conservation(cfg, folder, resume=True)
    # Restored, it resumes to the same result as an uninterrupted run.
    (folder / RunFolder.CHECKPOINT).write_bytes(good)
    resumed = run_conservation(cfg, folder, resume=True)
    ref = run_conservation(cfg, tmp_path / "ref")
    assert resumed["final"] == ref["final"]
    assert RunFolder(folder).metrics() == RunFolder(tmp_path / "ref").metrics()


def test_cli_resume_with_a_planted_pickle_is_one_line_exit_2(tmp_path, capsys):
    """``flowgeom continuity train ... --resume`` (in-process main): exit 2, one stderr line, marker absent."""
    from flowgeom.cli import main

    out = tmp_path / "mlp"
    argv = ["continuity", "train", "mlp", "--variant", "Res+None", "--steps", "4", "--log-every", "1",
            "--out", str(out), "--set", "width=8", "--set", "depth=3", "--set", "train_limit=64",
            "--set", "test_limit=32", "--set", "ckpt_every=2"]
    assert main(argv) == 0
    (out / "summary.json").unlink()  # make it look killed before the end
    (out / RunFolder.CHECKPOINT).unlink()
    marker = tmp_path / "pwned"
    plant_pickle(out / "checkpoint.pt", marker)
    capsys.readouterr()
    assert main(argv + ["--resume"]) == 2
    assert not marker.exists()
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("flowgeom") and "error:" in last and "old pickle format" in last


@pytest.mark.slow
def test_sweep_driver_subprocess_refuses_the_planted_pickle(tmp_path):
    """The real reproduce handler in its own process (the kill -9 test's driver): that run fails, nothing runs."""
    out = tmp_path / "sweep"
    cmd = [sys.executable, str(REPO / "tests" / "experiments" / "_sweep_fakes.py"), "reproduce", "laws", "--quick",
           "--out", str(out), "--json"]
    reproduce([fakes.counter_claim()], out=out, show_progress=False)  # the driver's claim, run in-process
    run = _first_run(out)
    for name in ("summary.json", RunFolder.CHECKPOINT):
        (run / name).unlink()
    marker = tmp_path / "pwned"
    plant_pickle(run / "checkpoint.pt", marker)
    r = subprocess.run(cmd + ["--resume"], capture_output=True, text=True)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert not marker.exists()
    payload = json.loads(r.stdout)
    assert payload["sweep"]["failed"] == 1 and payload["sweep"]["skipped"] == 2
    assert "old pickle format" in payload["sweep"]["runs"][0]["error"] + payload["sweep"]["runs"][1]["error"] \
        + payload["sweep"]["runs"][2]["error"]


# ---------------------------------------------------------------- checkpoint format: exact, and damage is an error

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.text(max_size=8),
                     st.floats(allow_nan=True, allow_infinity=True))
_dtypes = st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.uint8, torch.bool])


@st.composite
def _tensors(draw):
    shape = draw(st.lists(st.integers(0, 3), max_size=3))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    t = torch.randn(shape, generator=gen, dtype=torch.float64) * 100
    return t.to(draw(_dtypes))


_keys = st.one_of(st.text(max_size=6), st.integers(-3, 3), st.sampled_from(["__tensor__", "__tuple__", "a.b"]))
_trees = st.recursive(st.one_of(_scalars, _tensors()), lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.lists(inner, max_size=3).map(tuple),
    st.dictionaries(_keys, inner, max_size=3)), max_leaves=12)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.text(max_size=6), _trees, max_size=4))
def test_checkpoint_round_trip_is_exact(state):
    back = decode_checkpoint(encode_checkpoint(state))
    assert same(back, state)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_damaged_checkpoint_is_an_error_or_the_same_state(data):
    opt_param = torch.nn.Parameter(torch.arange(6.0))
    opt = torch.optim.Adam([opt_param], lr=0.1)
    opt_param.grad = torch.ones(6)
    opt.step()
    state = {"step": 7, "time": 0.25, "optimizer": opt.state_dict(), "generator": torch.Generator().get_state()}
    blob = encode_checkpoint(state)
    if data.draw(st.booleans(), label="truncate"):
        damaged = blob[: data.draw(st.integers(0, len(blob) - 1), label="cut")]
    else:
        at = data.draw(st.integers(0, len(blob) - 1), label="at")
        damaged = blob[:at] + bytes([blob[at] ^ data.draw(st.integers(1, 255), label="xor")]) + blob[at + 1:]
    try:
        back = decode_checkpoint(damaged, source="the test checkpoint")
    except FlowgeomError as exc:
        assert "the test checkpoint is corrupt or truncated" in str(exc)
    else:  # a flip in the header's padding or whitespace: harmless, the content must be identical
        assert same(back, state)


def test_code_is_never_saved():
    with pytest.raises(FlowgeomError, match="cannot checkpoint a function at sched.*never code"):
        encode_checkpoint({"sched": lambda k: 0.1})


def test_langevin_callable_schedule_resumes_exactly_through_a_checkpoint(tmp_path):
    def lr(k):
        return 0.05 / (1 + k)

    def make(seed):
        p = torch.nn.Parameter(torch.linspace(-1, 1, 5))
        return p, Langevin([p], lr=lr, temperature=0.3, seed=seed)

    def steps(p, opt, n):
        for _ in range(n):
            opt.zero_grad()
            (p ** 4).sum().backward()
            opt.step()

    p, opt = make(0)
    steps(p, opt, 3)
    run = RunFolder(tmp_path / "r")
    run.save_checkpoint({"p": p, "optimizer": opt.state_dict()})
    steps(p, opt, 4)
    ckpt = run.load_checkpoint()
    assert ckpt["optimizer"]["param_groups"][0]["lr"] == "schedule"
    q, opt2 = make(seed=123)  # another seed: the generator state must come from the checkpoint
    with torch.no_grad():
        q.copy_(ckpt["p"])
    opt2.load_state_dict(ckpt["optimizer"])
    steps(q, opt2, 4)
    assert torch.equal(p, q) and opt2.step_count == 7
    plain = Langevin([torch.nn.Parameter(torch.zeros(5))], lr=0.1, temperature=0.3)
    with pytest.raises(FlowgeomError, match="callable lr schedule"):
        plain.load_state_dict(ckpt["optimizer"])


# ---------------------------------------------------------------- 2. tampered sweep results are redone

CLAIM_N, SEEDS = 4, (0, 1)


def _sweep(out: Path, *, resume: bool):
    """The whole reproduce pipeline (sweep, verdict, report) on the fake counter claim."""
    return reproduce([fakes.counter_claim(n=CLAIM_N, seeds=SEEDS)], out=out, resume=resume, show_progress=False)


def _sweep_only(out: Path, *, resume: bool) -> dict:
    """Just the sweep (no figures, no report): the counts of finished/skipped/failed runs."""
    specs = plan([fakes.counter_claim(n=CLAIM_N, seeds=SEEDS)], scale="quick", out=out)
    return run_sweep(specs, resume=resume).as_dict()


def _summaries(out: Path) -> dict[str, dict]:
    return {p.parent.name: json.loads(p.read_text()) for p in sorted(out.glob("runs/*/*/summary.json"))}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref")
    report = _sweep(out, resume=False)
    return out, _summaries(out), report["claims"][0]["verdict"]


def _first_run(out: Path) -> Path:
    return sorted(out.glob("runs/fake.counter/*/summary.json"))[0].parent


def _edit_number(run: Path):
    s = json.loads((run / "summary.json").read_text())
    s["acc"] += 1
    (run / "summary.json").write_text(json.dumps(s, indent=2) + "\n")
    return "summary.json changed"


def _truncate(run: Path):
    text = (run / "summary.json").read_bytes()
    (run / "summary.json").write_bytes(text[: len(text) // 2])
    return "summary.json changed"


def _list(run: Path):
    (run / "summary.json").write_text("[1, 2]\n")
    return "summary.json changed"


def _edit_metrics(run: Path):
    lines = (run / "metrics.jsonl").read_text().splitlines()
    rec = json.loads(lines[-1])
    rec["acc"] = 0
    lines[-1] = json.dumps(rec)
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return "metrics.jsonl changed"


def _drop_metrics(run: Path):
    (run / "metrics.jsonl").unlink()
    return "metrics.jsonl is missing"


def _add_file(run: Path):
    (run / "extra.json").write_text("{}\n")
    return "extra.json appeared"


@pytest.mark.parametrize("tamper", [_edit_number, _truncate, _list, _edit_metrics, _drop_metrics, _add_file],
                         ids=lambda f: f.__name__.strip("_"))
def test_a_tampered_finished_run_is_redone_with_a_warning(tmp_path, capsys, reference, tamper):
    ref_out, ref_summaries, ref_verdict = reference
    out = tmp_path / "sweep"
    _sweep_only(out, resume=False)
    run = _first_run(out)
    what = tamper(run)
    capsys.readouterr()
    sweep = _sweep_only(out, resume=True)
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("flowgeom: warning:")]
    assert len(warnings) == 1 and f"fake.counter/{run.name}" in warnings[0] and what in warnings[0]
    assert (sweep["finished"], sweep["skipped"], sweep["failed"]) == (1, len(SEEDS) - 1, 0)
    assert _summaries(out) == ref_summaries
    assert (out / "rejected" / "fake.counter" / run.name / "config.json").exists()
    # The redone run is recorded again: a second resume keeps everything, silently.
    sweep = _sweep_only(out, resume=True)
    assert sweep["skipped"] == len(SEEDS) and "warning" not in capsys.readouterr().err


def test_the_verdict_after_a_tampered_summary_is_the_untampered_one(tmp_path, capsys, reference):
    """End to end through reproduce: an edited number would change the claim's measured figure; it does not."""
    out = tmp_path / "sweep"
    _sweep(out, resume=False)
    run = _first_run(out)
    _edit_number(run)
    report = _sweep(out, resume=True)
    assert f"run fake.counter/{run.name} is redone: summary.json changed" in capsys.readouterr().err
    assert report["claims"][0]["verdict"]["measured"] == reference[2]["measured"]
    assert report["claims"][0]["verdict"]["verdict"] == "reproduced" and report["sweep"]["finished"] == 1


@pytest.mark.parametrize("manifest", ["delete", "garbage", "list"])
def test_no_trustworthy_manifest_means_every_run_is_redone(tmp_path, capsys, reference, manifest):
    out = tmp_path / "sweep"
    _sweep_only(out, resume=False)
    path = out / "manifest.json"
    if manifest == "delete":
        path.unlink()
    else:
        path.write_text("{not json" if manifest == "garbage" else "[1, 2]")
    capsys.readouterr()
    sweep = _sweep_only(out, resume=True)
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == len(SEEDS) and all("manifest.json" in w for w in warnings)
    assert sweep["finished"] == len(SEEDS) and _summaries(out) == reference[1]


def test_a_non_object_summary_is_never_reused_even_with_a_matching_manifest(tmp_path, capsys, reference):
    out = tmp_path / "sweep"
    _sweep_only(out, resume=False)
    run = _first_run(out)
    (run / "summary.json").write_text("[1, 2]\n")
    manifest = json.loads((out / "manifest.json").read_text())
    import hashlib
    key = f"fake.counter/{run.name}"
    manifest["runs"][key]["files"]["summary.json"] = hashlib.sha256(b"[1, 2]\n").hexdigest()
    (out / "manifest.json").write_text(json.dumps(manifest))
    sweep = _sweep_only(out, resume=True)
    err = capsys.readouterr().err
    assert f"run {key} is redone: summary.json is not a JSON object" in err
    assert sweep["finished"] == 1 and _summaries(out) == reference[1]


def test_a_tampered_run_that_cannot_be_moved_aside_is_refused_not_reused(tmp_path, capsys, reference):
    out = tmp_path / "sweep"
    _sweep(out, resume=False)
    run = _first_run(out)
    _edit_number(run)
    (out / "rejected").write_text("a file where the rejected/ folder would go\n")
    report = _sweep(out, resume=True)
    sweep = report["sweep"]
    assert sweep["failed"] == 1 and sweep["skipped"] == len(SEEDS) - 1
    failure = report["failures"][0]
    assert failure["run"] == f"fake.counter/{run.name}" and "cannot be trusted (summary.json changed" in failure["error"]
    verdict = report["claims"][0]["verdict"]
    # The verdict uses only the trusted run: its sum is that run's acc, not the tampered one's.
    trusted = [s for name, s in reference[1].items() if name != run.name]
    assert verdict["measured"] == f"sum of final acc = {sum(s['acc'] for s in trusted)}"
    assert "1 of 2 runs failed" in verdict["how"]


# ---------------------------------------------------------------- RunFolder.summary on damaged files

@pytest.mark.parametrize("text,match", [("[1, 2]", "JSON list, not an object"), ("{\"a\": 1", "not readable JSON"),
                                        ("", "not readable JSON"), ("3", "JSON int, not an object")])
def test_summary_of_a_damaged_file_is_a_clear_error(tmp_path, text, match):
    run = RunFolder(tmp_path)
    (tmp_path / "summary.json").write_text(text)
    with pytest.raises(FlowgeomError, match=match + ".*must be redone"):
        run.summary()
    assert RunFolder(tmp_path / "nothing").summary() is None


# ---------------------------------------------------------------- 3. strict JSON

_json_trees = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-10**20, 10**20), st.text(max_size=5),
              st.floats(allow_nan=True, allow_infinity=True)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)),
    max_leaves=15)


def _expected(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, list):
        return [_expected(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _expected(v) for k, v in obj.items()}
    return obj


@settings(max_examples=50, deadline=None)
@given(_json_trees)
def test_to_json_is_strict_and_maps_non_finite_to_null(obj):
    assert strict_loads(to_json(obj)) == _expected(obj)


def test_tensors_numpy_and_metrics_lines_are_strict(tmp_path):
    import numpy as np

    obj = {"t": torch.tensor([1.0, float("nan"), float("-inf")]), "s": torch.tensor(float("inf")),
           "np": np.float32("nan"), "arr": np.array([np.inf, 2.0]), "ok": 0.5}
    assert strict_loads(to_json(obj)) == {"t": [1.0, None, None], "s": None, "np": None, "arr": [None, 2.0],
                                          "ok": 0.5}
    run = RunFolder(tmp_path)
    run.start({"lr": float("inf")}, resume=False)
    run.log({"step": 0, "loss": float("nan")})
    run.finish({"final_loss": float("nan")})
    for name in ("config.json", "metrics.jsonl", "summary.json"):
        for line in (tmp_path / name).read_text().splitlines() if name.endswith("l") else [(tmp_path / name).read_text()]:
            strict_loads(line)
    assert run.metrics() == [{"step": 0, "loss": None}] and run.summary() == {"final_loss": None}
