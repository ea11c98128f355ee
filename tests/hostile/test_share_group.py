"""``compress run --group`` is bounded by the model's layers (issue 35 §4): refused up front, with the range.

``--group 99999999999999999999`` was accepted (and silently meant "all
layers", or was ignored by the per-layer methods). No config may declare more
than 4096 layers, so a larger group is refused when the flags are parsed; a
group above this model's layer count is refused before calibration, with
``1..L``. Nothing is written either way.
"""

from __future__ import annotations

import pytest

from test_file_numbers import folder  # noqa: F401  (the tiny 2-layer Llama folder fixture; tests/hostile on sys.path)
from tree_digest import snapshot  # noqa: E402


@pytest.mark.parametrize("method", ["svd", "whiten", "basis-sharing"])
def test_an_absurd_group_is_refused_when_parsed(tmp_path, cli, folder, method):  # noqa: F811
    before = snapshot(tmp_path)
    rc, _, err = cli(["compress", "run", folder, "--out", tmp_path / "o", "--method", method, "--rank", "2",
                      "--group", "99999999999999999999"])
    assert rc == 2 and err.strip() == ("flowgeom compress run: error: argument --group: must be a whole number "
                                       "between 1 and 4096, got 99999999999999999999; see `flowgeom compress "
                                       "run --help`")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("method", ["basis-sharing", "share"])
def test_a_group_beyond_the_layers_is_refused_before_calibration(tmp_path, cli, folder, method):  # noqa: F811
    # the calibration text is too short for --calib-tokens: reaching calibration would be a different error
    before = snapshot(tmp_path)
    rc, _, err = cli(["compress", "run", folder, "--out", tmp_path / "o", "--method", method, "--rank", "2",
                      "--group", "3", "--calib", tmp_path / "text.txt", "--calib-tokens", "512"])
    assert rc == 2 and err.strip() == ("flowgeom: error: --group 3 is outside 1..2, the number of layers of the "
                                       "model; pass a smaller --group")
    assert snapshot(tmp_path) == before


def test_the_whole_model_as_one_group_is_accepted(tmp_path, cli, folder, strict_json):  # noqa: F811
    (tmp_path / "long.txt").write_text(" ".join(f"w{i * 7 % 31}" for i in range(1200)))
    rc, out, _ = cli(["compress", "run", folder, "--out", tmp_path / "o", "--method", "basis-sharing", "--rank",
                      "2", "--group", "2", "--calib", tmp_path / "long.txt", "--calib-tokens", "1024", "--json"])
    assert rc == 0 and (tmp_path / "o").is_dir()
    assert [0, 1] in strict_json(out)["roles"]["q"]["groups"]
