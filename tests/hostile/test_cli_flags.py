"""Hostile CLI flags (issue #13): every bad value is a designed outcome, never a crash.

A designed outcome is exit 0, or exit 2 with exactly one line
``flowgeom...: error: ...`` on stderr; the ``cli`` fixture (conftest.py)
fails any case that reaches the last-resort guard or leaks a traceback.
"""

from __future__ import annotations

import argparse
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flowgeom.cli import _common, main

BIG_SEED = str(2**63)


def _case(*argv, frag):
    return pytest.param(list(argv), frag, id=" ".join(argv)[:60])


# Refused while parsing: nothing runs, nothing is written.
USAGE_ERRORS = [
    _case("langevin", "villani", "--seed", "-1", frag="--seed"),
    _case("langevin", "villani", "--seed", BIG_SEED, frag="2**63"),
    _case("langevin", "villani", "--seed", "1.5", frag="whole number"),
    _case("langevin", "villani", "--threads", "100000", frag="--threads"),
    _case("langevin", "villani", "--threads", "0", frag="--threads"),
    _case("langevin", "villani", "--rays", "0", frag="--rays"),
    _case("langevin", "villani", "--temperature", "0", frag="--temperature"),
    _case("langevin", "villani", "--temperature", "nan", frag="finite"),
    _case("langevin", "villani", "--r-max", "inf", frag="--r-max"),
    _case("langevin", "villani", "--points", "3", frag="--points"),
    _case("langevin", "villani", "--probes", "1", frag="--probes"),
    _case("langevin", "villani", "--figure", "v.xyz", frag=".png"),
    _case("langevin", "villani", "--figure", "v", frag=".svg"),
    _case("langevin", "rate", "--chains", "0", frag="--chains"),
    _case("langevin", "rate", "--lr", "1e300", frag="--lr"),
    _case("langevin", "rate", "--regs", "none,none", frag="twice"),
    _case("langevin", "rate", "--regs", "none,bogus", frag="bogus"),
    _case("langevin", "darcy", "--out", "d", "--steps", "0", frag="--steps"),
    _case("langevin", "darcy", "--out", "d", "--lr", "1e300", frag="--lr"),
    _case("langevin", "darcy", "--out", "d", "--temperature", "-1", frag="--temperature"),
    _case("langevin", "darcy", "--out", "d", "--seed", "-3", frag="--seed"),
    _case("conserve", "run", "--seeds", "-1", frag="--seeds"),
    _case("conserve", "run", "--seeds", "0", frag="--seeds"),
    _case("conserve", "run", "--steps", "0", frag="--steps"),
    _case("conserve", "run", "--batch", "0", frag="--batch"),
    _case("conserve", "run", "--lr", "1e300", frag="--lr"),
    _case("conserve", "run", "--lr", "0.1", "--lr", "0.1", frag="twice"),
    _case("conserve", "run", "--arch", "vit", "--arch", "vit", frag="twice"),
    _case("conserve", "run", "--weight-decay", "-1", frag="--weight-decay"),
    _case("conserve", "run", "--threads", "100000", frag="--threads"),
    _case("conserve", "scaling", "--steps", "0", frag="--steps"),
    _case("conserve", "scaling", "--decay-steps", "0", frag="--decay-steps"),
    _case("conserve", "scaling", "--tau", "0.02", "--tau", "0.02", frag="twice"),
    _case("continuity", "train", "mlp", "--out", "t", "--lr", "1e10", frag="--lr"),
    _case("continuity", "train", "mlp", "--out", "t", "--steps", "0", frag="--steps"),
    _case("continuity", "train", "mlp", "--out", "t", "--seed", BIG_SEED, frag="--seed"),
    _case("continuity", "ablate", "--out", "t", "--figure", "a.docx", frag=".pdf"),
    _case("continuity", "analyze", "m.safetensors", "--k", "0", frag="--k"),
    _case("continuity", "analyze", "m.safetensors", "--distance", "0", frag="--distance"),
    _case("continuity", "analyze", "m.safetensors", "--distance", "1,1", frag="distinct"),
    _case("continuity", "analyze", "m.safetensors", "--threshold", "-1", frag="--threshold"),
    _case("continuity", "analyze", "m.safetensors", "--threads", "100000", frag="--threads"),
    _case("reproduce", "laws", "--out", "r", "--jobs", "0", frag="--jobs"),
    _case("reproduce", "laws", "--out", "r", "--only", "x", "--only", "x", frag="twice"),
]


@pytest.mark.parametrize("argv,frag", USAGE_ERRORS)
def test_bad_flag_is_one_usage_line_and_nothing_written(argv, frag, cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, out, err = cli(argv)
    assert rc == 2 and frag in err, err
    assert out == ""
    assert list(tmp_path.iterdir()) == [], "a refused command must not leave files behind"


@pytest.mark.parametrize("setting,frag", [
    ("width=abc", "whole number"), ("width=1.5", "whole number"), ("depth=null", "whole number"),
    ("train_limit=-5", ">= 1"), ("residual=maybe", "true or false"), ("init_scale=nan", "finite"),
    ("widht=3", "valid: variant, residual"), ("seed=-1", "2**63"),
])
def test_set_values_are_typed_from_the_config(setting, frag, cli, tmp_path):
    out = tmp_path / "run"
    rc, _, err = cli(["continuity", "train", "mlp", "--out", out, "--set", setting])
    assert rc == 2 and f"--set {setting.split('=')[0]}" in err and frag in err, err
    assert not out.exists(), "validate first, write last"


@pytest.mark.parametrize("variants,frag", [(",", "empty"), ("NoRes,NoRes", "twice"), ("NoRes,Bogus", "Bogus")])
def test_ablate_variant_lists_are_checked_before_training(variants, frag, cli, tmp_path):
    rc, _, err = cli(["continuity", "ablate", "--variants", variants, "--out", tmp_path / "a"])
    assert rc == 2 and frag in err
    assert not (tmp_path / "a").exists()


def test_set_null_is_accepted_for_optional_fields():
    from flowgeom.cli.continuity_train import _parse_sets
    from flowgeom.experiments.continuity_lm import LMRunConfig
    from flowgeom.experiments.continuity_mlp import MLPRunConfig

    sets = _parse_sets(["train_limit=null", "residual=false", "init_scale=0.5", "log_every=7"], MLPRunConfig)
    assert sets == {"train_limit": None, "residual": False, "init_scale": 0.5, "log_every": 7}
    assert _parse_sets(["d_model=16", "mlp=gelu"], LMRunConfig) == {"d_model": 16, "mlp": "gelu"}


def test_seed_overflow_from_seed_plus_seeds_is_refused_before_training(cli, tmp_path):
    rc, _, err = cli(["conserve", "run", "--seed", str(2**63 - 1), "--seeds", "2", "--out", tmp_path / "c"])
    assert rc == 2 and "2**63" in err
    assert not (tmp_path / "c").exists()


def test_reproduce_jobs_zero_leaves_no_out_folder(cli, tmp_path):
    rc, _, err = cli(["reproduce", "laws", "--out", tmp_path / "r", "--jobs", "0"])
    assert rc == 2 and not (tmp_path / "r").exists()


def test_reproduce_into_a_file_is_one_line(cli, tmp_path):
    target = tmp_path / "file"
    target.write_text("not a folder")
    rc, _, err = cli(["reproduce", "laws", "--out", target])
    assert rc == 2 and "not writable" in err and target.read_text() == "not a folder"


def test_figure_naming_a_directory_is_refused_before_training(cli, tmp_path):
    rc, _, err = cli(["continuity", "ablate", "--out", tmp_path / "a", "--figure", tmp_path])
    assert rc == 2 and "directory" in err and ".png" in err
    assert not (tmp_path / "a").exists()


def test_figure_extensions_come_from_matplotlib():
    from matplotlib.backend_bases import FigureCanvasBase

    from flowgeom.report.figures import check_figure_path, figure_formats

    assert set(figure_formats()) <= set(FigureCanvasBase.get_supported_filetypes())
    assert {"png", "pdf", "svg"} <= set(figure_formats())
    assert check_figure_path("fig.PDF").name == "fig.PDF"


# -- validators: the accepted range is exactly what the consumers accept ---------------------------

@settings(max_examples=50, deadline=None)
@given(st.integers(min_value=-(2**70), max_value=2**70))
def test_seed_accepts_exactly_what_torch_generators_take(value):
    try:
        parsed = _common.seed(str(value))
    except argparse.ArgumentTypeError:
        assert not 0 <= value < 2**63
        return
    assert parsed == value
    torch.Generator().manual_seed(parsed)  # must not raise


@settings(max_examples=50, deadline=None)
@given(st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(repr), st.text(max_size=8)))
def test_step_size_is_finite_positive_and_capped(text):
    try:
        value = _common.step_size(text)
    except argparse.ArgumentTypeError as exc:
        assert str(exc) and "\n" not in str(exc)
        return
    assert math.isfinite(value) and 0 < value <= _common.MAX_STEP_SIZE


def test_threads_bound_is_the_cpu_count():
    import os

    cpus = os.cpu_count() or 1
    assert _common.threads(str(cpus)) == cpus
    with pytest.raises(argparse.ArgumentTypeError, match=str(cpus)):
        _common.threads(str(cpus + 1))


def test_print_json_is_strict_even_for_nan_payloads(capsys, strict_json):
    _common.print_json({"a": float("nan"), "b": [1.0, float("inf")], "c": torch.tensor(float("-inf"))})
    assert strict_json(capsys.readouterr().out) == {"a": None, "b": [1.0, None], "c": None}


# -- runs that go wrong: one line, exit 2, no result presented as complete -------------------------

def test_villani_tiny_temperature_gives_no_integral_verdict(cli, strict_json):
    argv = ["langevin", "villani", "--loss", "attention", "--temperature", "1e-300", "--rays", "1", "--points", "4"]
    rc, out, _ = cli([*argv, "--json"])
    assert rc == 0
    report = strict_json(out)
    assert report["orbit_integral"]["verdict"] == "undefined" and "temperature" in report["orbit_integral"]["reason"]
    rc, out, _ = cli(argv)
    assert rc == 0 and "no verdict" in out and "converges" not in out and "inf" not in out.split("orbit:")[-1]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(temperature=st.floats(min_value=1e-320, max_value=1e300), r_max=st.floats(min_value=10.5, max_value=1e29),
       points=st.integers(4, 8), seed=st.integers(0, 2**63 - 1))
def test_villani_random_numeric_flags_never_crash(cli, strict_json, temperature, r_max, points, seed):
    rc, out, _ = cli(["langevin", "villani", "--loss", "norm2", "--rays", "1", "--temperature", repr(temperature),
                      "--r-max", repr(r_max), "--points", str(points), "--seed", str(seed), "--json"])
    assert rc in (0, 2)
    if rc == 0:
        assert strict_json(out)["verdict"] in ("holds", "fails", "inconclusive")


def test_villani_absurd_rays_refused_by_the_memory_estimate(cli):
    rc, _, err = cli(["langevin", "villani", "--rays", "100000000"])
    assert rc == 2 and "GiB" in err and "--rays" in err


def test_villani_and_laws_json_are_strict(cli, strict_json):
    rc, out, _ = cli(["langevin", "villani", "--loss", "norm1", "--rays", "1", "--points", "4", "--json"])
    assert rc == 0 and strict_json(out)["verdict"] == "fails"
    rc, out, _ = cli(["laws", "list", "--json"])
    assert rc == 0 and len(strict_json(out)) > 3


def test_continuity_train_divergence_is_one_error_line(cli, tmp_path):
    out = tmp_path / "mlp"
    rc, stdout, err = cli(["continuity", "train", "mlp", "--out", out, "--optimizer", "sgd", "--lr", "1e6",
                           "--steps", "20", "--log-every", "10", "--set", "width=8", "--set", "depth=2",
                           "--set", "train_limit=256", "--set", "test_limit=16"])
    assert rc == 2 and "lower the learning rate" in err and str(out) in err
    assert stdout == "", "no table for a run that stopped"


def test_conserve_run_divergence_is_one_error_line(cli, tmp_path, strict_json):
    rc, stdout, err = cli(["conserve", "run", "--arch", "mha-rope-swiglu", "--regime", "gd", "--lr", "1e5",
                           "--steps", "5", "--out", tmp_path / "c", "--json"])
    assert rc == 2 and "diverged" in err
    runs = strict_json(stdout)["runs"]
    assert [r["diverged"] for r in runs] == [True], "a diverged run is flagged, never presented as complete"


@pytest.mark.slow
def test_langevin_rate_divergence_is_one_error_line(cli):
    rc, stdout, err = cli(["langevin", "rate", "--lr", "1e6", "--chains", "4", "--steps", "20", "--json"])
    assert rc == 2 and "lower lr" in err and stdout == ""


@pytest.mark.slow
def test_langevin_darcy_divergence_is_one_error_line(cli, tmp_path, strict_json):
    rc, stdout, err = cli(["langevin", "darcy", "--out", tmp_path / "d", "--lr", "1e6", "--steps", "20",
                           "--pretrain-steps", "0", "--regs", "log,power", "--json"])
    assert rc == 2 and "2 of 2 Langevin arms diverged" in err
    arms = strict_json(stdout)["arms"]
    assert {a["status"] for a in arms.values()} == {"diverged"}


# -- the last-resort guard -------------------------------------------------------------------------

def _break_demo(monkeypatch, exc: BaseException) -> None:
    from flowgeom.cli import demo

    def boom(args):
        raise exc

    monkeypatch.setattr(demo, "run_demo", boom)


def test_guard_turns_a_bug_into_one_line_exit_1(monkeypatch, capsys):
    monkeypatch.delenv("FLOWGEOM_DEBUG", raising=False)
    _break_demo(monkeypatch, ZeroDivisionError("float division\nby zero"))
    assert main(["demo"]) == 1
    err = capsys.readouterr().err
    assert err == ("flowgeom: internal error: ZeroDivisionError: float division by zero — "
                   "rerun with --debug for the traceback\n")


@pytest.mark.parametrize("how", ["flag", "env"])
def test_debug_shows_the_traceback(how, monkeypatch, capsys):
    _break_demo(monkeypatch, KeyError("x"))
    if how == "env":
        monkeypatch.setenv("FLOWGEOM_DEBUG", "1")
        argv = ["demo"]
    else:
        monkeypatch.delenv("FLOWGEOM_DEBUG", raising=False)
        argv = ["--debug", "demo"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "in boom" in err and err.rstrip().endswith("internal error: KeyError: 'x'")


def test_interrupt_keeps_130_and_argparse_keeps_its_codes(monkeypatch, capsys):
    _break_demo(monkeypatch, KeyboardInterrupt())
    assert main(["demo"]) == 130
    for argv, code in ((["--help"], 0), (["demo", "--bogus"], 2)):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == code
    assert "internal error" not in capsys.readouterr().err


def test_the_installed_command_guards_in_a_subprocess(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    exe = Path(sys.executable).with_name("flowgeom")
    env = {**os.environ, "FLOWGEOM_DEBUG": "0"}
    proc = subprocess.run([str(exe), "langevin", "villani", "--threads", "100000"], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "--threads" in proc.stderr


def test_villani_figure_in_new_folder_is_written_in_its_format(cli, tmp_path):
    path = tmp_path / "new" / "sub" / "v.svg"
    rc, _, _ = cli(["langevin", "villani", "--loss", "norm2", "--rays", "1", "--points", "4", "--figure", path])
    assert rc == 0 and b"<svg" in path.read_bytes()[:2000]


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self"), reason="needs Linux /proc")
def test_villani_figure_that_cannot_be_written_is_one_error_line(cli):
    rc, _, err = cli(["langevin", "villani", "--loss", "norm2", "--rays", "1", "--points", "4",
                      "--figure", "/proc/flowgeom-h4.png"])
    assert rc == 2 and "cannot write the figure" in err


# -- every typed flag of these commands, fed arbitrary text: parsed, or one usage line ----------------

PREFIXES = {
    ("langevin", "villani"): [], ("langevin", "rate"): [], ("langevin", "darcy"): ["--out", "d"],
    ("conserve", "run"): [], ("conserve", "scaling"): [], ("continuity", "analyze"): ["m.safetensors"],
    ("continuity", "train"): ["mlp", "--out", "t"], ("continuity", "ablate"): ["--out", "t"],
    ("reproduce",): ["laws"],
}


def _typed_flags():
    from flowgeom.cli import build_parser

    parser = build_parser()
    found = []
    for path, prefix in PREFIXES.items():
        p = parser
        for name in path:
            sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
            p = sub.choices[name]
        for action in p._actions:
            if action.option_strings and action.type not in (None, str) and action.nargs is None:
                found.append((path, prefix, action.option_strings[-1]))
    return found


TYPED_FLAGS = _typed_flags()


def test_the_sweep_covers_the_numeric_flags():
    flags = {(path, flag) for path, _, flag in TYPED_FLAGS}
    assert (("langevin", "villani"), "--temperature") in flags and (("conserve", "run"), "--seeds") in flags
    assert len(flags) >= 40


@settings(max_examples=50, deadline=None)
@given(case=st.sampled_from(TYPED_FLAGS),
       text=st.one_of(st.integers(-(2**70), 2**70).map(str), st.floats().map(repr), st.text(max_size=6),
                      st.sampled_from(["0", "-1", "1e300", "nan", "inf", "1,1", "", "2**63", "0x10"])))
def test_any_text_for_a_typed_flag_parses_or_is_one_usage_line(case, text):
    import contextlib
    import io

    from flowgeom.cli import build_parser

    path, prefix, flag = case
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            build_parser().parse_args([*path, *prefix, f"{flag}={text}"])
        except SystemExit as exc:
            assert exc.code == 2
            lines = err.getvalue().splitlines()
            assert len(lines) == 1 and lines[0].startswith("flowgeom") and "error:" in lines[0], err.getvalue()


@pytest.mark.parametrize("command", [["continuity", "analyze", "builtin:minilm"],
                                     ["compress", "evaluate", "builtin:smollm2", "--tokens", "300"]])
@pytest.mark.parametrize("where", ["folder", "under_a_file"])
def test_an_out_file_that_cannot_be_written_is_refused_before_the_work(command, where, cli, tmp_path, monkeypatch):
    """--out naming a folder, or a path under a file, used to fail only after the whole analysis or evaluation."""
    import flowgeom.continuity as continuity
    import flowgeom.nn.llama as llama

    def never(*args, **kwargs):
        raise AssertionError("the work started before --out was checked")

    monkeypatch.setattr(continuity, "analyze", never)
    monkeypatch.setattr(llama, "load_llama", never)
    (tmp_path / "afile").write_text("mine")
    out = tmp_path if where == "folder" else tmp_path / "afile" / "report.json"
    rc, _, err = cli([*command, "--out", out])
    assert rc == 2 and ("is a folder" in err if where == "folder" else "is a file, not a folder" in err), err
    assert (tmp_path / "afile").read_text() == "mine"
