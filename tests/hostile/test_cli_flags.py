"""Hostile CLI flags: every bad value is a one-line usage error (exit 2), never a crash."""

from __future__ import annotations


def test_unknown_area_is_a_usage_error(cli):
    rc, _, err = cli(["no-such-area"], one_line=False)
    assert rc == 2
