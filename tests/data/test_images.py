"""Image loaders on tiny files made here: CIFAR-10 python batches, class folders, MNIST dispatch."""

import importlib.util
import pickle

import numpy as np
import pytest
import torch

from flowgeom.data.images import load_cifar10, load_image_folder, load_images
from flowgeom.errors import FlowgeomError


def _cifar(folder, n=3):
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i, name in enumerate([f"data_batch_{j}" for j in range(1, 6)] + ["test_batch"]):
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        with open(folder / name, "wb") as fh:
            pickle.dump({b"data": data, b"labels": [(i + j) % 10 for j in range(n)]}, fh)
    return folder


def test_cifar_batches(tmp_path):
    folder = _cifar(tmp_path / "cifar-10-batches-py")
    x, y = load_cifar10(tmp_path)
    assert x.shape == (15, 3, 32, 32) and x.dtype == torch.uint8 and y.tolist()[:3] == [0, 1, 2]
    with open(folder / "test_batch", "rb") as fh:
        raw = pickle.load(fh)
    xt, yt = load_images(str(folder), "test")
    assert torch.equal(xt[1, 2].flatten(), torch.from_numpy(raw[b"data"][1, 2048:]))  # channel-major rows
    assert load_cifar10(folder, limit=4)[0].shape[0] == 4


def test_cifar_errors(tmp_path):
    folder = _cifar(tmp_path / "c")
    (folder / "data_batch_3").unlink()
    with pytest.raises(FlowgeomError, match="data_batch_3"):
        load_cifar10(folder)
    (folder / "data_batch_3").write_bytes(b"not a pickle")
    with pytest.raises(FlowgeomError, match="not a CIFAR-10"):
        load_cifar10(folder)


def test_class_folder_npy_and_pt(tmp_path):
    for split in ("train", "test"):
        for c, name in enumerate(["cat", "dog"]):
            d = tmp_path / split / name
            d.mkdir(parents=True)
            np.save(d / "a.npy", np.full((5, 5, 3), c, dtype=np.uint8))  # (H, W, C)
            torch.save(torch.full((3, 5, 5), 10 + c, dtype=torch.uint8), d / "b.pt")  # (C, H, W)
    x, y, classes = load_image_folder(tmp_path, "train")
    assert classes == ["cat", "dog"] and x.shape == (4, 3, 5, 5) and y.tolist() == [0, 0, 1, 1]
    assert x[1].unique().tolist() == [10] and x[2].unique().tolist() == [1]
    xt, yt = load_images(str(tmp_path), "test")
    assert xt.shape == (4, 3, 5, 5)


def test_class_folder_errors(tmp_path):
    with pytest.raises(FlowgeomError, match="does not exist"):
        load_image_folder(tmp_path / "nope")
    (tmp_path / "a").mkdir()
    np.save(tmp_path / "a" / "x.npy", np.zeros((4, 4), dtype=np.uint8))
    (tmp_path / "b").mkdir()
    np.save(tmp_path / "b" / "y.npy", np.zeros((5, 5), dtype=np.uint8))
    with pytest.raises(FlowgeomError, match="different shapes"):
        load_image_folder(tmp_path)
    with pytest.raises(FlowgeomError, match="neither"):
        load_images(str(tmp_path / "missing"))


@pytest.mark.skipif(importlib.util.find_spec("PIL") is not None, reason="Pillow installed: pictures are readable")
def test_pictures_without_pillow_say_so(tmp_path):
    (tmp_path / "cls").mkdir()
    (tmp_path / "cls" / "img.png").write_bytes(b"\x89PNG")
    with pytest.raises(FlowgeomError, match="Pillow"):
        load_image_folder(tmp_path)


def test_mnist_dispatch():
    x, y = load_images("mnist", "test", limit=7)
    assert x.shape == (7, 1, 28, 28) and y.shape == (7,) and int(x.max()) > 100


@pytest.mark.skipif(importlib.util.find_spec("PIL") is None, reason="Pillow not installed")
def test_png_pictures_with_pillow(tmp_path):
    from PIL import Image

    (tmp_path / "cls").mkdir()
    Image.fromarray(np.full((6, 6, 3), 7, dtype=np.uint8)).save(tmp_path / "cls" / "a.png")
    x, y, _ = load_image_folder(tmp_path)
    assert x.shape == (1, 3, 6, 6) and x.unique().tolist() == [7]
