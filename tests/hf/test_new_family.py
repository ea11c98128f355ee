"""A new family is one entry of the family table: the monitor, ``laws count hf:`` and
``continuity analyze`` all pick it up, with nothing else edited.

Helium (Kyutai, a real ``transformers`` config class not in the table) is added in a
fresh process before the rest of flowgeom is imported, exactly as an edit of
``FAMILIES`` would be; everything below reads the table.
"""

import json
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("transformers")

SCRIPT = textwrap.dedent("""
    import json, sys, warnings
    from flowgeom.hf import families
    assert "helium" not in families.FAMILIES
    families.FAMILIES["helium"] = families.llama_like("helium", "Helium", tiny=families.TINY_DECODER)

    import torch
    from flowgeom.cli import main
    from flowgeom.hf.tiny import tiny_model
    from flowgeom.laws import ConservationMonitor

    out = {}
    model = tiny_model("helium", seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor = ConservationMonitor(model, per_block=False)
    out["uncovered"] = [u["block"] for u in monitor.uncovered_list()]
    out["laws"] = sorted(monitor.families("eps"))
    model.float().save_pretrained(sys.argv[1], safe_serialization=True)
    print(json.dumps(out))
""")


def _cli(*argv: str) -> dict:
    done = subprocess.run([sys.executable, "-c", SCRIPT.split("import torch")[0] + textwrap.dedent("""
        from flowgeom.cli import main
        sys.exit(main(sys.argv[1:]))
    """), *argv], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_a_new_family_entry_reaches_the_monitor_the_counter_and_the_naming(tmp_path):
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "helium")], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    monitor = json.loads(done.stdout.strip().splitlines()[-1])
    assert monitor["uncovered"] == [] and any("attn" in k for k in monitor["laws"]), monitor

    for part in ("attention", "mlp", "block"):
        count = _cli("laws", "count", f"hf:helium:{part}", "--json")
        assert count["expected"] is not None and count["laws"] == count["expected"], (part, count)

    report = _cli("continuity", "analyze", str(tmp_path / "helium"), "--json")
    assert set(report["roles"]) == {"q", "k", "v", "o", "gate", "up", "down"} and report["layers"] == 2
    assert all(u["reason"] in ("1-D (norm/bias)", "embedding / LM head") for u in report["unmatched"])


def test_without_the_entry_helium_is_refused_by_name():
    done = subprocess.run([sys.executable, "-m", "flowgeom", "laws", "count", "hf:helium:attention"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "unknown model_type 'helium'" in done.stderr
