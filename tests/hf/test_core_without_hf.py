"""flowgeom imports and works without transformers / peft (they are the optional ``hf`` extra)."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import sys
    sys.modules["transformers"] = None   # any import of them now raises ImportError
    sys.modules["peft"] = None
    import torch
    import flowgeom, flowgeom.laws, flowgeom.continuity, flowgeom.langevin, flowgeom.hf
    from flowgeom.cli import main
    from flowgeom.laws import ConservationMonitor
    from flowgeom.nn import SwiGLU
    mon = ConservationMonitor(SwiGLU(4, 3), warn=False)
    assert any(k.startswith("eps/") for k in mon.measure())
    assert main(["laws", "show", "swiglu", "--d-model", "3", "--d-hidden", "2"]) == 0
    rc = main(["laws", "count", "hf:llama:attention"])
    print("HF_RC", rc)
""")


def test_core_works_and_hf_targets_fail_cleanly_without_transformers():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "HF_RC 2" in proc.stdout
    err = [line for line in proc.stderr.splitlines() if line.startswith("flowgeom")]
    assert err and "pip install 'flowgeom[hf]'" in err[-1] and "Traceback" not in proc.stderr
