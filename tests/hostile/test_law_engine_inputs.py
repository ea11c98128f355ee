"""Hostile input to the law engine: `flowgeom laws count|discover|show` (issue #13).

Every case builds the bad input for real (a .py file written into tmp_path,
an absurd flag) and asserts a designed outcome: exit 0 with a correct
result, or exit 2 with one line naming the problem; never a traceback, a
silent exit 0/7 from the user's module, or the kernel's OOM killer.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from flowgeom.errors import FlowgeomError

HEADER = textwrap.dedent("""
    import sys
    import torch
    from torch import nn

    class Base(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2, bias=False)

        def forward(self, x):
            return self.lin(x)
""")

# name -> (class body appended to HEADER, fragment the one-line error must contain)
MODULES = {
    "sample_list": ("class M(Base):\n    def sample_input(self, n, g):\n        return [[0.0] * 3] * n\n",
                    "sample_input(batch, generator) returned a list"),
    "sample_str": ("class M(Base):\n    def sample_input(self, n, g):\n        return 'x'\n", "returned a str"),
    "sample_none": ("class M(Base):\n    def sample_input(self, n, g):\n        return None\n", "returned a NoneType"),
    "sample_wrong_batch": ("class M(Base):\n    def sample_input(self, n, g):\n        return torch.randn(n + 1, 3, generator=g)\n",
                           "first dim is batch"),
    "sample_scalar": ("class M(Base):\n    def sample_input(self, n, g):\n        return torch.tensor(1.0)\n",
                      "returned shape ()"),
    "sample_signature": ("class M(Base):\n    def sample_input(self, n, g, extra):\n        return torch.randn(n, 3)\n",
                         "missing 1 required positional argument"),
    "sample_raises": ("class M(Base):\n    def sample_input(self, n, g):\n        raise RuntimeError('no data here')\n",
                      "raised RuntimeError: no data here"),
    "sample_exits": ("class M(Base):\n    def sample_input(self, n, g):\n        sys.exit(3)\n", "raised SystemExit"),
    "sample_nan": ("class M(Base):\n    def sample_input(self, n, g):\n        return torch.full((n, 3), float('nan'))\n",
                   "inputs contain NaN or Inf"),
    "forward_counter": ("class M(Base):\n    calls = 0\n    def forward(self, x):\n        type(self).calls += 1\n"
                        "        if type(self).calls > 1:\n            raise RuntimeError('only once')\n        return self.lin(x)\n",
                        "after a first call that worked: RuntimeError: only once"),
    "forward_dict": ("class M(Base):\n    def forward(self, x):\n        return {'y': self.lin(x)}\n",
                     "must return one floating-point tensor, got dict"),
    "forward_int": ("class M(Base):\n    def forward(self, x):\n        return self.lin(x).long()\n",
                    "got a int64 tensor"),
    "forward_nan": ("class M(Base):\n    def forward(self, x):\n        return self.lin(x) * float('nan')\n",
                    "outputs contain NaN or Inf"),
    "forward_inf": ("class M(Base):\n    def forward(self, x):\n        return self.lin(x) + float('inf')\n",
                    "outputs contain NaN or Inf"),
    "gradient_nan": ("class M(Base):\n    def forward(self, x):\n        return torch.sqrt(self.lin(x) * 0)\n",
                     "fields (gradients) contain NaN or Inf"),
    "weights_nan": ("class M(Base):\n    def __init__(self):\n        super().__init__()\n"
                    "        with torch.no_grad():\n            self.lin.weight[0, 0] = float('nan')\n",
                    "'lin.weight' contains NaN or Inf"),
    "meta_device": ("def M():\n    with torch.device('meta'):\n        return Base()\n", "on the meta device"),
    "int_parameter": ("class M(Base):\n    def __init__(self):\n        super().__init__()\n"
                      "        self.k = nn.Parameter(torch.ones(2, dtype=torch.long), requires_grad=False)\n"
                      "    def forward(self, x):\n        return self.lin(x) * self.k\n",
                      "'k' has dtype int64"),
    "constructor_exits": ("class M(Base):\n    def __init__(self):\n        sys.exit(5)\n", "sys.exit(5)"),
    "import_exit0": ("sys.exit(0)\nM = Base\n", "it called sys.exit(0)"),
    "import_exit7": ("sys.exit(7)\nM = Base\n", "it called sys.exit(7)"),
    "import_raises": ("raise ImportError('missing dependency zzz')\nM = Base\n", "ImportError: missing dependency zzz"),
}


def _write(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / f"{name}.py"
    path.write_text(HEADER + "\n" + body)
    return path


@pytest.mark.parametrize("name", sorted(MODULES))
def test_misbehaving_module_is_one_line_exit_2(cli, tmp_path, name):
    body, fragment = MODULES[name]
    path = _write(tmp_path, name, body)
    rc, out, err = cli(["laws", "count", f"{path}:M", "--input-shape", "3"])
    assert rc == 2, (rc, out, err)
    assert fragment in err
    if name.startswith("import_"):
        assert str(path) in err  # the error names the file


@pytest.mark.parametrize("name", ["sample_wrong_batch", "forward_nan", "gradient_nan", "meta_device", "import_exit7"])
def test_discover_refuses_the_same_modules(cli, tmp_path, name):
    body, fragment = MODULES[name]
    path = _write(tmp_path, name, body)
    rc, _, err = cli(["laws", "discover", f"{path}:M", "--input-shape", "3"])
    assert rc == 2 and fragment in err


def test_sys_exit_at_import_does_not_end_the_process_silently(tmp_path):
    """The real console script: exit 7 (or 0) from the user's file must become exit 2 with a message."""
    path = _write(tmp_path, "exits", "sys.exit(7)\nM = Base\n")
    exe = Path(sys.executable).with_name("flowgeom")
    proc = subprocess.run([str(exe), "laws", "count", f"{path}:M", "--input-shape", "3"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc
    assert proc.stderr.startswith("flowgeom: error: could not import") and str(path) in proc.stderr
    assert "sys.exit(7)" in proc.stderr and proc.stderr.count("\n") == 1


def test_good_module_next_to_bad_ones_still_counts(cli, tmp_path):
    """Control: the same file layout with a well-behaved module succeeds (the checks are not blanket refusals)."""
    path = _write(tmp_path, "good", "class M(Base):\n    def sample_input(self, n, g):\n        return torch.randn(n, 3, generator=g)\n")
    rc, out, _ = cli(["laws", "count", f"{path}:M", "--json"])
    data = json.loads(out)
    assert rc == 0 and data["parameters"] == 6 and data["laws"] == 0  # one linear layer: W(θ) is all of R^6


@pytest.mark.parametrize("shape,fragment", [
    ("0", "positive integers"), ("-3", "positive integers"), ("4.5", "positive integers"), ("1e3", "positive integers"),
    ("", "positive integers"), ("a,b", "positive integers"), ("1,1,1,1,1,1,1,1,1", "1 to 8"),
    ("1000000,1000000", "1,000,000,000,000 elements"),
])
@pytest.mark.parametrize("verb", ["count", "discover"])
def test_absurd_input_shape_refused_when_parsed(cli, tmp_path, verb, shape, fragment):
    path = _write(tmp_path, "plain", "M = Base\n")
    rc, _, err = cli(["laws", verb, f"{path}:M", f"--input-shape={shape}"])
    assert rc == 2 and "--input-shape" in err and fragment in err


def test_input_shape_within_bounds_but_too_big_for_memory(cli, tmp_path):
    """4M elements per input passes the parser; the engine's blocks of 8192 such inputs do not fit: refused with numbers."""
    path = _write(tmp_path, "wide", "class M(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
                                    "        self.lin = nn.Linear(2048, 1, bias=False)\n"
                                    "    def forward(self, x):\n        return self.lin(x).sum()\n")
    rc, _, err = cli(["laws", "count", f"{path}:M", "--input-shape", "2048,2048"])
    assert rc == 2 and "GiB" in err and "available" in err and "smaller --input-shape" in err


@pytest.mark.parametrize("depth", ["-1", "17", "2.5", "x"])
def test_max_depth_out_of_range_is_a_usage_error(cli, depth):
    rc, _, err = cli(["laws", "count", "relu2", f"--max-depth={depth}"])
    assert rc == 2 and "--max-depth" in err


def test_max_depth_zero_counts_without_brackets_and_says_so(cli):
    # relu2 (d_in 3, width 2, d_out 2): D = 10, one law per neuron; the fields alone already span D − 2.
    rc, out, _ = cli(["laws", "count", "relu2", "--d-in", "3", "--width", "2", "--d-out", "2", "--max-depth", "0", "--json"])
    data = json.loads(out)
    assert rc == 0 and data["ranks_by_depth"] == [data["rank"]] and data["laws"] == 2
    assert any("max_depth 0" in n and "upper bound" in n for n in data["notes"])


@pytest.mark.parametrize("tol", ["0", "-1e-9", "nan", "inf", "-inf", "1", "1e300", "abc"])
def test_bad_tol_refused_at_parse_time_with_the_range(cli, tol):
    rc, _, err = cli(["laws", "count", "relu2", f"--tol={tol}"])  # `=`: argparse would read -1e-9 as a flag
    assert rc == 2 and "--tol" in err and "(0, 1)" in err


def test_tol_below_rounding_refused_by_the_library(cli):
    rc, _, err = cli(["laws", "count", "relu2", "--tol", "1e-300"])
    assert rc == 2 and "tolerance must be" in err and "float64" in err


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tol=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(1e-13, 1e-5)))
def test_tol_property_correct_count_or_one_line_error(cli, tol):
    """relu2 (d_in 2, width 2, d_out 2) has 2 laws; any accepted tol in a sane range must find exactly them."""
    rc, out, err = cli(["laws", "count", "relu2", "--d-in", "2", "--width", "2", "--d-out", "2", f"--tol={tol!r}", "--json"])
    assert rc in (0, 2), (rc, err)
    if rc == 2:
        assert not (math.isfinite(tol) and 1e-13 <= tol <= 1e-5), err  # sane tolerances are accepted
        return
    data = json.loads(out)
    assert 0 < tol < 1 and data["tolerance"] == tol and 0 <= data["laws"] <= data["parameters"] == 8
    if 1e-13 <= tol <= 1e-5:
        assert data["laws"] == 2


def test_laws_show_absurd_fields_refused_at_parse_time(cli):
    rc, _, err = cli(["laws", "show", "swiglu", "--fields", "100000000"])
    assert rc == 2 and "--fields" in err and "100000" in err


@pytest.mark.parametrize("argv", [
    ["laws", "show", "swiglu", "--d-hidden", "100000"],
    ["laws", "show", "swiglu", "--d-hidden", "20000", "--fields", "100000"],
    ["laws", "show", "mha", "--seq-len", "100000"],  # 64 fields × 2 heads × T² attention scores
    ["laws", "count", "swiglu", "--d-model", "1000000", "--d-hidden", "1000000"],  # the module alone: 24 TiB
    ["laws", "discover", "ffn", "--d-model", "1000000", "--d-hidden", "1000000"],
])
def test_memory_blowups_refused_with_the_estimate(cli, argv):
    rc, _, err = cli(argv)
    assert rc == 2 and "GiB" in err and "available" in err and "smaller" in err


def test_check_memory_estimate_grows_with_fields_and_width():
    from flowgeom.laws.describe import check_memory, require_check_memory

    small, d_small = check_memory("swiglu", {"d_hidden": 8}, n_fields=64)
    wide, d_wide = check_memory("swiglu", {"d_hidden": 80}, n_fields=64)
    many, _ = check_memory("swiglu", {"d_hidden": 8}, n_fields=640)
    assert (d_small, d_wide) == (144, 1440) and wide > 9 * small and many > 9 * small
    require_check_memory("swiglu", {"d_hidden": 8}, n_fields=64, max_memory=small + 1)  # fits: no error
    with pytest.raises(FlowgeomError, match="GiB"):
        require_check_memory("swiglu", {"d_hidden": 8}, n_fields=64, max_memory=small - 1)


def test_discover_refuses_a_system_too_big_for_memory(cli, tmp_path, monkeypatch):
    """f(x) = (Σ w) x: W(θ) = span{1}, so each point's complement has D − 1 dims and the system ~D² unknowns.

    The limit is lowered (the real available_memory is replaced by 64 MiB) so that the refusal comes
    before the expensive part at a small D; the arithmetic is the real one.
    """
    monkeypatch.setattr("flowgeom.memory.available_memory", lambda device: 64 * 2**20)  # the one memory reader
    path = _write(tmp_path, "sumw", "class M(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
                                    "        self.w = nn.Parameter(torch.randn(60))\n"
                                    "    def forward(self, x):\n        return self.w.sum() * x\n")
    rc, _, err = cli(["laws", "discover", f"{path}:M", "--input-shape", "2"])
    assert rc == 2 and "symmetry system" in err and "GiB" in err and "laws count" in err


@pytest.mark.parametrize("verb", ["count", "discover", "show", "list"])
@pytest.mark.parametrize("seed", ["-1", str(2**64), str(2**70), "1.5"])
def test_out_of_range_seed_is_a_usage_error(cli, verb, seed):
    argv = ["laws", verb] + ([] if verb == "list" else ["relu2"]) + [f"--seed={seed}"]
    rc, _, err = cli(argv)
    assert rc == 2 and "--seed" in err


@pytest.mark.parametrize("seed", [-1, 2**64, 2**70, 1.5, True])
def test_library_entry_points_refuse_bad_seeds(seed):
    from flowgeom.laws.count import count
    from flowgeom.laws.discover import discover
    from flowgeom.laws.target import resolve

    lin = nn.Linear(2, 2)
    sampler = lambda n, g: torch.randn(n, 2, generator=g, dtype=torch.float64)  # noqa: E731
    for call in (lambda: count(lin, sampler, seed=seed), lambda: discover(lin, sampler, seed=seed),
                 lambda: resolve("relu2", seed=seed)):
        with pytest.raises(FlowgeomError, match="seed must be a whole number"):
            call()


def test_library_count_refuses_bad_tol_and_depth():
    from flowgeom.laws.count import count

    lin = nn.Linear(2, 2)
    sampler = lambda n, g: torch.randn(n, 2, generator=g, dtype=torch.float64)  # noqa: E731
    for tol in (0.0, -1.0, float("nan"), float("inf"), 1.0, 1e300):
        with pytest.raises(FlowgeomError, match="tolerance must be"):
            count(lin, sampler, tol=tol)
    for depth in (-1, 17):
        with pytest.raises(FlowgeomError, match="max_depth"):
            count(lin, sampler, max_depth=depth)
