"""Fixtures shared by the hostile-input tests (tests/hostile/).

``cli(argv)`` runs ``flowgeom.cli.main(argv)`` in-process and returns
``(rc, stdout, stderr)``. It fails the test when the CLI's last-resort guard
was reached (stderr says "internal error") or a traceback leaked, and, for
exit code 2, when the error is not exactly one line ``flowgeom...: error: ...``.
A hostile input must end in a *designed* outcome: success or a usage error.

``strict_json(text)`` parses ``--json`` output refusing NaN/Infinity, which
Python's ``json`` module accepts by default but no strict parser does.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest


class _StrictJSONError(ValueError):
    pass


def _refuse_constant(name: str):
    raise _StrictJSONError(f"non-standard JSON constant {name} in --json output")


def parse_strict_json(text: str):
    """``json.loads`` that refuses NaN, Infinity and -Infinity."""
    return json.loads(text, parse_constant=_refuse_constant)


@pytest.fixture
def strict_json():
    return parse_strict_json


@pytest.fixture
def cli(capsys, monkeypatch):
    """Run ``main(argv)`` in-process; return ``(rc, out, err)``; guard the outcome.

    Pass ``one_line=False`` for commands that legitimately write progress to
    stderr before failing; the last stderr line must still be the error.
    """
    from flowgeom.cli import main

    monkeypatch.delenv("FLOWGEOM_DEBUG", raising=False)

    def run(argv: Sequence[str], *, one_line: bool = True) -> tuple[int, str, str]:
        capsys.readouterr()  # drop anything printed before this call
        try:
            rc = main([str(a) for a in argv])
        except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
            code = exc.code
            rc = code if isinstance(code, int) else (0 if code is None else 1)
        out, err = capsys.readouterr()
        shown = " ".join(map(str, argv))
        if "internal error" in err or "Traceback" in err:
            pytest.fail(f"`flowgeom {shown}` reached the last-resort guard or leaked a traceback:\n{err}")
        if rc == 2:
            lines = [line for line in err.splitlines() if line.strip()]
            if not lines:
                pytest.fail(f"`flowgeom {shown}` exited 2 with nothing on stderr")
            if one_line and len(lines) != 1:
                pytest.fail(f"`flowgeom {shown}` exit-2 error is {len(lines)} lines, not one:\n{err}")
            last = lines[-1]
            if not (last.startswith("flowgeom") and "error:" in last):
                pytest.fail(f"`flowgeom {shown}` exit-2 error line is not 'flowgeom...: error: ...':\n{err}")
        return rc, out, err

    return run
