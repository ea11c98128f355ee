"""TARGET strings: zoo names, file.py:NAME, package.module:NAME, inputs, and every failure as FlowgeomError."""

import textwrap

import pytest
import torch
from torch import nn

from flowgeom.errors import FlowgeomError
from flowgeom.laws.target import parse_shape, resolve

BLOCK = textwrap.dedent("""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 3)

        def forward(self, x):  # (4, 8) -> (4, 3)
            return torch.tanh(self.lin(x))

    class NeedsArgs(nn.Module):
        def __init__(self, width):
            super().__init__()

    def make_block():
        return Block()

    def not_a_module():
        return 42
""")


@pytest.fixture
def block_file(tmp_path):
    path = tmp_path / "my_block.py"
    path.write_text(BLOCK)
    return path


def test_zoo_name_with_size_options():
    t = resolve("mha", size_options={"heads": 3, "d_k": 2}, seed=1)
    assert t.arch == "mha" and t.module.n_heads == 3 and "--heads 3" in t.label
    x = t.sampler(5, torch.Generator().manual_seed(0))
    assert x.shape == (5, 1, t.module.seq_len, t.module.d_model)  # each draw: a batch of one


def test_file_class_and_factory_with_input_shape(block_file):
    for name in ("Block", "make_block"):
        t = resolve(f"{block_file}:{name}", input_shape="4,8", seed=0)
        assert isinstance(t.module, nn.Module) and t.arch is None
        assert t.sampler(2, torch.Generator()).shape == (2, 4, 8)


def test_same_seed_same_weights(block_file):
    a, b = (resolve(f"{block_file}:Block", input_shape="4,8", seed=7).module for _ in range(2))
    assert torch.equal(a.lin.weight, b.lin.weight)


def test_package_module_target(block_file, monkeypatch):
    monkeypatch.syspath_prepend(str(block_file.parent))
    t = resolve("my_block:make_block", input_shape=(4, 8))
    assert t.module.lin.out_features == 3


@pytest.mark.parametrize("target,match", [
    ("nosuch", "unknown target 'nosuch'"),
    ("no_such_pkg_xyz.mod:Thing", "could not import module"),
    ("missing/file.py:Thing", "no such file"),
    (":Thing", "malformed target"),
])
def test_unresolvable_targets(target, match):
    with pytest.raises(FlowgeomError, match=match):
        resolve(target)


def test_file_errors_name_the_fix(block_file):
    with pytest.raises(FlowgeomError, match="candidates: Block, NeedsArgs, make_block, not_a_module"):
        resolve(f"{block_file}:Nope", input_shape="4,8")
    with pytest.raises(FlowgeomError, match="zero-argument factory"):
        resolve(f"{block_file}:NeedsArgs", input_shape="4,8")
    with pytest.raises(FlowgeomError, match="not an nn.Module"):
        resolve(f"{block_file}:not_a_module", input_shape="4,8")
    with pytest.raises(FlowgeomError, match="--input-shape"):
        resolve(f"{block_file}:Block")
    with pytest.raises(FlowgeomError, match="only apply to zoo architectures"):
        resolve(f"{block_file}:Block", size_options={"heads": 2}, input_shape="4,8")


def test_broken_file_is_one_error(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(FlowgeomError, match="could not import .*boom"):
        resolve(f"{bad}:X")


@pytest.mark.parametrize("text,shape", [("4,8", (4, 8)), ("3", (3,)), ("2x5", (2, 5))])
def test_parse_shape(text, shape):
    assert parse_shape(text) == shape


@pytest.mark.parametrize("text", ["", "a,b", "0,3", "-1"])
def test_parse_shape_rejects(text):
    with pytest.raises(FlowgeomError, match="--input-shape"):
        parse_shape(text)
