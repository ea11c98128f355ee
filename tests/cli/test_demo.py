"""``flowgeom demo`` ends with its own time against the README's figure; the two texts stay in step."""

from __future__ import annotations

from pathlib import Path

from flowgeom.cli import demo

ROOT = Path(__file__).resolve().parents[2]


def test_readme_states_the_figure_the_demo_compares_with():
    assert demo.README_TOUR in (ROOT / "README.md").read_text(encoding="utf-8")


def test_tour_line_compares_with_the_readme():
    line = demo.tour_line(demo.README_TOUR_SECONDS * 2 + 1)
    assert line.startswith("tour: ") and demo.README_TOUR in line and "(2.0× that)" in line
    assert "kept from an earlier tour" in demo.tour_line(10, kept=3)
    assert "kept" not in demo.tour_line(10)
