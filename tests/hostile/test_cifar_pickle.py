"""CIFAR-10 python batches are pickles: a forged one must be refused before it can run code.

The batches are read by a restricted unpickler (``flowgeom.data.images``)
that resolves only numpy's array/dtype reconstructors and ``_codecs.encode``.
Each hostile batch here *would* run code (or build a non-numeric array) under
plain ``pickle.load``; the test proves that first, then that flowgeom refuses
it with one line, exit 2, and runs nothing.
"""

from __future__ import annotations

import hashlib
import pickle

import numpy as np
import pytest

from flowgeom.data.images import load_cifar10
from flowgeom.errors import FlowgeomError

NAMES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]


class _Payload:
    """Pickles to a call of ``exec`` that writes ``marker`` (what an attacker's batch would do)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('pwned')",))


def _batch(n=4, seed=0):
    rng = np.random.default_rng(seed)
    return {b"batch_label": b"training batch", b"labels": [int(v) for v in rng.integers(0, 10, n)],
            b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), b"filenames": [b"a.png"] * n}


def _folder(tmp_path, raw_first: bytes, *, protocol=4):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for i, name in enumerate(NAMES):
        (folder / name).write_bytes(raw_first if i == 0 else pickle.dumps(_batch(seed=i), protocol=protocol))
    return folder


def _digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_real_batches_still_load(tmp_path, protocol):
    batch = _batch(seed=1)
    folder = _folder(tmp_path, pickle.dumps(batch, protocol=protocol), protocol=protocol)
    x, y = load_cifar10(folder)
    assert x.shape == (20, 3, 32, 32) and y.shape == (20,)
    assert np.array_equal(x[:4].reshape(4, 3072).numpy(), batch[b"data"]) and y[:4].tolist() == batch[b"labels"]


def test_numpy1_python2_style_batch_loads(tmp_path):
    """The official files name ``numpy.core.multiarray`` (numpy 1); that spelling is accepted too."""
    raw = pickle.dumps(_batch(seed=2), protocol=2)
    assert b"numpy._core.multiarray" in raw
    raw = raw.replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
    folder = _folder(tmp_path, raw)
    x, _ = load_cifar10(folder)
    assert np.array_equal(x[:4].reshape(4, 3072).numpy(), _batch(seed=2)[b"data"])


def test_code_running_pickle_is_refused_via_cli(tmp_path, cli):
    marker = tmp_path / "PWNED"
    evil = pickle.dumps({**_batch(), b"x": _Payload(marker)}, protocol=4)
    probe = tmp_path / "probe"
    pickle.loads(pickle.dumps(_Payload(probe)))  # plain pickle would run it: the file is really hostile
    assert probe.read_text() == "pwned"
    folder = _folder(tmp_path, evil)
    before = _digest(folder)
    out = tmp_path / "out"
    rc, _, err = cli(["conserve", "run", "--task", "vit", "--images", folder, "--out", out, "--steps", "1",
                      "--seeds", "1", "--regime", "gd", "--lr", "0.1"])
    assert rc == 2
    assert err.strip() == (f"flowgeom: error: {folder / 'data_batch_1'} was refused and not unpickled: it refers to "
                           "builtins.exec, which a CIFAR-10 batch never does (a pickle that names other globals can "
                           "run code); pass the official CIFAR-10 python batches")
    assert not marker.exists()
    assert _digest(folder) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cifar-10-batches-py", "out", "probe"]


@pytest.mark.parametrize("value, message", [
    (np.array([object(), 1], dtype=object), "dtype object"),
    (np.ma.masked_array([1, 2]), "numpy.ma.core"),
])
def test_non_numeric_arrays_are_refused(tmp_path, value, message):
    folder = _folder(tmp_path, pickle.dumps({**_batch(), b"x": value}, protocol=2))
    with pytest.raises(FlowgeomError, match="was refused and not unpickled") as info:
        load_cifar10(folder)
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("batch, message", [
    ([1, 2, 3], "holds a list, not a dict"),
    ({b"data": np.zeros((2, 3072), np.uint8), b"labels": ["cat", "dog"]}, "not class ids 0..9"),
    ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [1, 99]}, "not class ids 0..9"),
    ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [1]}, "no (N, 3072) b'data' with N b'labels'"),
    ({b"data": np.zeros((2, 3072), np.complex64), b"labels": [1, 2]}, "no (N, 3072) b'data'"),
])
def test_malformed_batches_say_what_is_wrong(tmp_path, batch, message):
    folder = _folder(tmp_path, pickle.dumps(batch, protocol=4))
    with pytest.raises(FlowgeomError) as info:
        load_cifar10(folder)
    assert message in str(info.value) and "\n" not in str(info.value)
