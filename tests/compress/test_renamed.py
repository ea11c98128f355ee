"""The names of the removed ``share`` command fail loudly, naming what replaced them (no silent alias)."""

import importlib

import pytest

OLD_NEW = [("share_model", "run_compression"), ("ShareConfig", "CompressionConfig"), ("Shared", "CompressionResult")]
RENAMED = ([(module, old, new) for module in ("flowgeom.compress", "flowgeom.compress.run") for old, new in OLD_NEW]
           + [("flowgeom.compress.stream", "stream_share", "stream_compression")])


@pytest.mark.parametrize("module,old,new", RENAMED)
def test_an_old_name_is_an_import_error_naming_the_new_one(module, old, new):
    with pytest.raises(ImportError, match=f"{module}.{old} was renamed: use {module}.{new}"):
        exec(f"from {module} import {old}", {})
    assert callable(getattr(importlib.import_module(module), new))  # and the new name is there


def test_any_other_missing_name_is_the_usual_error():
    import flowgeom.compress as compress

    with pytest.raises(AttributeError, match="has no attribute 'share_models'"):
        compress.share_models  # noqa: B018
    with pytest.raises(ImportError, match="cannot import name 'nothing'"):
        exec("from flowgeom.compress.run import nothing", {})
    from flowgeom.compress import heal  # submodules still import through the package's __getattr__

    assert heal.__name__ == "flowgeom.compress.heal"
