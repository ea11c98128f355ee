"""``flowgeom reproduce --export DIR``: the small outputs of a real sweep, never its checkpoints or links."""

from __future__ import annotations

import json

from flowgeom.cli import main


def _sweep(tmp_path, *extra):
    out, dest = tmp_path / "sweep", tmp_path / "results"
    code = main(["reproduce", "laws", "--quick", "--only", "laws.mha", "--out", str(out), *extra,
                 "--export", str(dest)])
    return code, out, dest


def test_export_copies_report_and_run_summaries_but_not_checkpoints(tmp_path, capsys):
    code, out, dest = _sweep(tmp_path)
    assert code == 0
    assert (dest / "report.md").is_file() and (dest / "report.json").is_file()
    summaries = sorted(p.relative_to(dest) for p in dest.rglob("summary.json"))
    assert summaries and summaries == sorted(p.relative_to(out) for p in out.rglob("summary.json"))
    # plant what a training claim leaves behind, then re-export through a resume (no run is redone)
    run_dir = next(out.rglob("summary.json")).parent
    (run_dir / "checkpoint.safetensors").write_bytes(b"\0" * 64)
    (run_dir / "huge.png").write_bytes(b"\x89PNG" + b"\0" * 3_000_000)  # JSON would trip the manifest
    secret = tmp_path / "secret.txt"
    secret.write_text("do not copy")
    (run_dir / "link.txt").symlink_to(secret)
    code, _, _ = _sweep(tmp_path, "--resume")
    assert code == 0
    rel = run_dir.relative_to(out)
    assert not (dest / rel / "checkpoint.safetensors").exists()
    assert not (dest / rel / "huge.png").exists()
    assert not (dest / rel / "link.txt").exists()
    left = json.loads((dest / "EXPORT.json").read_text())["left_behind"]
    assert str(rel / "checkpoint.safetensors") in left and str(rel / "huge.png") in left
    assert "exported" in capsys.readouterr().err


def test_export_inside_the_sweep_is_refused_before_running(tmp_path, capsys):
    out = tmp_path / "sweep"
    code = main(["reproduce", "laws", "--quick", "--only", "laws.mha", "--out", str(out),
                 "--export", str(out / "results")])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "overlaps the sweep folder" in err
    assert not out.exists()
