"""The one memory gate: ``require`` refuses above 80% of the available memory, names the numbers and the fix."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from flowgeom import memory
from flowgeom.errors import FlowgeomError, InputError
from flowgeom.memory import USABLE_FRACTION, budget, require

GIB = 2**30
SRC = Path(__file__).resolve().parents[1] / "src" / "flowgeom"


@pytest.fixture
def ten_gib(monkeypatch):
    seen = []

    def reader(device):
        seen.append(device.type)
        return 10 * GIB

    monkeypatch.setattr(memory, "available_memory", reader)
    return seen


def test_budget_is_the_usable_fraction_of_what_is_available(ten_gib):
    assert USABLE_FRACTION == 0.8
    assert budget() == budget("cpu") == 8 * GIB
    assert ten_gib == ["cpu", "cpu"]


def test_require_passes_at_the_limit_and_refuses_above_it(ten_gib):
    require(8 * GIB, "the thing", "do less")  # exactly the budget fits
    with pytest.raises(FlowgeomError) as err:
        require(8 * GIB + 1, "the thing", "do less")
    assert str(err.value) == ("the thing needs about 8.0 GiB, more than the 8.0 GiB it may use (80% of the 10.0 GiB "
                              "available); do less")
    assert not isinstance(err.value, InputError)


def test_an_explicit_limit_replaces_the_budget(ten_gib):
    require(9 * GIB, "the thing", "do less", limit=9 * GIB)  # above the budget, within the limit
    with pytest.raises(FlowgeomError, match=r"the thing needs about 0\.0 GiB, more than the 0\.0 GiB allowed "
                                            r"\(max_memory\); do less"):
        require(2000, "the thing", "do less", limit=1000)
    assert ten_gib == []  # the available memory is not even read


def test_the_device_is_asked(ten_gib):
    require(GIB, "x", "y", device="meta")
    assert ten_gib == ["meta"]


def test_a_cli_fix_makes_an_input_error(ten_gib):
    with pytest.raises(InputError) as err:
        require(9 * GIB, "D = 5 parameters", "pass device='cuda'", cli_fix="use --device cuda")
    assert str(err.value).endswith("available); pass device='cuda'")
    assert str(err.value.for_cli()).endswith("available); use --device cuda")


def test_real_gates_refuse_by_the_one_rule(ten_gib, monkeypatch):
    """The law count (with an explicit limit) and the law check (with the budget) refuse through require."""
    from flowgeom.laws.describe import check_memory, require_check_memory
    from flowgeom.laws import count
    from flowgeom.nn import build

    with pytest.raises(InputError, match="D = 144 parameters needs about .* GiB, more than the 0.0 GiB allowed"):
        count(build("swiglu"), max_memory=1000)
    need, _ = check_memory("swiglu", {"d_hidden": 8}, n_fields=64)
    require_check_memory("swiglu", {"d_hidden": 8}, n_fields=64)  # a few MB: fits in 8 GiB
    # 80% of this is just below the need (while half of it, the old second rule, was far below)
    monkeypatch.setattr(memory, "available_memory", lambda device: int(need / USABLE_FRACTION) - 8)
    with pytest.raises(FlowgeomError, match=r"checking swiglu .* more than the .* GiB it may use \(80% of the"):
        require_check_memory("swiglu", {"d_hidden": 8}, n_fields=64)
    monkeypatch.setattr(memory, "available_memory", lambda device: int(need / USABLE_FRACTION) + 8)
    require_check_memory("swiglu", {"d_hidden": 8}, n_fields=64)  # and just above it fits


def test_no_other_module_reads_the_available_memory():
    """``available_memory`` is called by flowgeom.memory alone: no gate with a rule of its own."""
    callers = []
    for path in SRC.rglob("*.py"):
        if path.name == "memory.py" and path.parent == SRC:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Name) and node.id == "available_memory" or \
                    isinstance(node, ast.Attribute) and node.attr == "available_memory":
                callers.append(f"{path.relative_to(SRC)}:{node.lineno}")
    allowed = {"laws/target.py"}  # owned by the family-table work: still spells int(0.8 * available_memory(...))
    assert {c.split(":")[0] for c in callers} <= allowed, callers
