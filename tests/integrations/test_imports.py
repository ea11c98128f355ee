"""The core and flowgeom.integrations import none of transformers, lightning, tensorboard, wandb at module level."""

from __future__ import annotations

import subprocess
import sys
import textwrap

HEAVY = ("transformers", "lightning", "tensorboard", "wandb", "torch.utils.tensorboard")

SCRIPT = textwrap.dedent("""
    import sys
    import flowgeom, flowgeom.laws, flowgeom.integrations
    import flowgeom.integrations.writers, flowgeom.integrations.session, flowgeom.integrations.figure
    import flowgeom.integrations.checkpoints, flowgeom.laws.verdict, flowgeom.laws.predict
    from flowgeom.cli import build_parser
    build_parser()
    print("LOADED", sorted(m for m in %r if m in sys.modules))
""" % (HEAVY,))

MISSING = textwrap.dedent("""
    import sys
    sys.modules["lightning"] = None   # the extra is not installed
    from flowgeom.errors import FlowgeomError
    import flowgeom.integrations as fi
    try:
        fi.ConservationLightningCallback
    except FlowgeomError as exc:
        print("ERR", exc)
""")


def test_nothing_heavy_is_imported():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "LOADED []" in proc.stdout, proc.stdout


def test_a_missing_extra_is_one_clear_error():
    proc = subprocess.run([sys.executable, "-c", MISSING], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "ERR" in proc.stdout and "pip install 'flowgeom[integrations]'" in proc.stdout, proc.stdout
