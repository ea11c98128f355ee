"""builtin: names resolve to files in installed data packages; other specs pass through as paths."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowgeom.errors import FlowgeomError
from flowgeom.io import BUILTINS, builtin_path, is_gguf, local_path


def test_unknown_builtin_lists_the_known_ones():
    with pytest.raises(FlowgeomError, match="builtin:smollm2") as err:
        builtin_path("builtin:nope")
    assert "'builtin:nope'" in str(err.value)


def test_local_path_resolves_builtins_only(tmp_path):
    assert local_path(tmp_path / "m.gguf") == tmp_path / "m.gguf"
    assert local_path(str(tmp_path)) == Path(tmp_path)
    with pytest.raises(FlowgeomError, match="unknown built-in source"):
        local_path("builtin:nope")


def test_builtin_files_are_found():
    for spec, (_, suffix, _) in BUILTINS.items():
        path = builtin_path(spec)
        assert path.is_file() and path.name.endswith(suffix)
        assert local_path(spec) == path


def test_is_gguf():
    assert is_gguf("builtin:smollm2") and is_gguf(Path("a/b.gguf")) and is_gguf("x.gguf")
    assert not is_gguf("model.safetensors") and not is_gguf(Path("folder"))
