import gzip

import numpy as np
import pytest
import torch

from flowgeom.data import CharVocab, lm_batch, load_mnist, load_text
from flowgeom.errors import FlowgeomError


def test_shipped_mnist_is_the_real_set():
    x, y = load_mnist("test")
    assert x.shape == (10_000, 28, 28) and x.dtype == torch.uint8
    assert torch.bincount(y).tolist()[:3] == [980, 1135, 1032]  # the known MNIST test label counts
    xt, yt = load_mnist("train", limit=5)
    assert yt.tolist() == [5, 0, 4, 1, 9]  # the first five MNIST training labels


def _write_idx(path, array, gz=False):
    header = bytes([0, 0, 8, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    data = header + array.astype(np.uint8).tobytes()
    (gzip.open if gz else open)(path, "wb").write(data)


def test_idx_folder_roundtrip_and_truncation(tmp_path):
    imgs = np.random.default_rng(0).integers(0, 255, (7, 28, 28))
    labs = np.arange(7) % 10
    _write_idx(tmp_path / "t10k-images-idx3-ubyte.gz", imgs, gz=True)
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte", labs)
    x, y = load_mnist("test", path=tmp_path)
    assert np.array_equal(x.numpy(), imgs) and y.tolist() == labs.tolist()
    raw = (tmp_path / "t10k-labels-idx1-ubyte").read_bytes()
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(raw[:-2])
    with pytest.raises(FlowgeomError, match="truncated"):
        load_mnist("test", path=tmp_path)
    with pytest.raises(FlowgeomError, match="no train-images"):
        load_mnist("train", path=tmp_path)


def test_kjv_text_and_vocab():
    text = load_text("kjv", split="valid")
    assert len(text) > 100_000 and "LORD" in load_text("kjv")
    vocab = CharVocab.from_text(text)
    ids = vocab.encode("In the beginning")
    assert vocab.decode(ids) == "In the beginning"
    x, y = lm_batch(vocab.encode(text), batch=4, seq_len=16, generator=torch.Generator().manual_seed(0))
    assert x.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])


def test_text_path_and_errors(tmp_path):
    (tmp_path / "wiki.train.tokens").write_text("hello world")
    assert load_text(str(tmp_path)) == "hello world"
    with pytest.raises(FlowgeomError, match="no valid file"):
        load_text(str(tmp_path), split="valid")
    with pytest.raises(FlowgeomError, match="neither"):
        load_text("/nonexistent/corpus")


def test_a_text_that_is_not_utf8_is_refused_with_where(tmp_path):
    (tmp_path / "train.txt").write_bytes("naïve text".encode("utf-8") + b"\x00\xff\xfe binary")
    with pytest.raises(FlowgeomError, match=r"not UTF-8 text \(byte 0xff at offset 12\)"):
        load_text(str(tmp_path))
    (tmp_path / "ok.txt").write_bytes("naïve café".encode("utf-8"))
    assert load_text(str(tmp_path / "ok.txt")) == "naïve café"  # multi-byte UTF-8 reads back exactly
