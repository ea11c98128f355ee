"""Stage progress on a pipe (cli/progress.py): a heartbeat line while a slow stage runs, an ETA, quiet fast stages."""

from __future__ import annotations

import io
import re
import time

from flowgeom.cli.progress import clock, stage_progress


def test_a_slow_unit_still_prints_heartbeats_with_an_eta():
    out = io.StringIO()
    with stage_progress(True, prefix="compress run", every=0.05, quiet=0.0, stream=out) as update:
        update("calibrate", 1, 4)
        time.sleep(0.3)  # one unit far longer than the heartbeat period
        update("calibrate", 4, 4)
    lines = out.getvalue().splitlines()
    beats = [l for l in lines if re.fullmatch(r"compress run: calibrate 1/4, \d+s elapsed, ETA \d+s", l)]
    assert len(beats) >= 2, lines
    assert lines[-1].startswith("compress run: calibrate 4/4 done in")


def test_a_quick_stage_prints_nothing_and_json_mode_gets_no_reporter():
    out = io.StringIO()
    with stage_progress(True, every=0.05, quiet=5.0, stream=out) as update:
        for i in range(1, 4):
            update("factorise", i, 3)
    assert out.getvalue() == ""
    with stage_progress(False, stream=out) as update:
        assert update is None


def test_a_new_stage_reports_where_the_last_one_stopped():
    out = io.StringIO()
    with stage_progress(True, prefix="p", every=10.0, quiet=0.0, stream=out) as update:
        update("heal", 2, 10)
        update("write", 1, 1)
    assert out.getvalue().splitlines()[0].startswith("p: heal 2/10,") and "write 1/1 done" in out.getvalue()


def test_clock():
    assert clock(5.4) == "5s" and clock(65) == "1m05s" and clock(3600) == "60m00s"
