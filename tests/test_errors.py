"""The shared bad-input helpers: messages name the field, the value and the valid options."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from flowgeom.errors import FlowgeomError, require_choices


def test_require_choices_reports_the_first_bad_field_in_order():
    cfg = SimpleNamespace(dtype="float16", solver="qr")
    with pytest.raises(FlowgeomError, match=r"unknown dtype 'float16'; choose one of: float32, float64"):
        require_choices(cfg, dtype=("float32", "float64"), solver=("auto", "dense"))
    require_choices(SimpleNamespace(dtype="float32"), dtype=("float32", "float64"))  # valid: no error
