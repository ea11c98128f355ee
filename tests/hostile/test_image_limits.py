"""Image files declare their own sizes; flowgeom checks the declaration before it allocates anything.

Each file here is forged by the test: an IDX header claiming billions of
images, a gzip stream far longer than its header, a ``.npy`` header larger
than its file, a PNG whose header declares a 5000 x 5000 picture, a CIFAR
pickle asking numpy for a 2 GB placeholder. Each is refused with one line
naming the file, the dimension and the limit (:data:`flowgeom.limits.IMAGE_LIMITS`),
in milliseconds and without the memory it asks for.
"""

from __future__ import annotations

import gzip
import hashlib
import pickle
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from flowgeom.data.images import load_cifar10, load_image_folder
from flowgeom.data.mnist import load_mnist
from flowgeom.errors import FlowgeomError

IDX_FIX = "pass a folder with MNIST-style IDX files"
IMAGE_FIX = "expected (H, W), (H, W, C) or (C, H, W) of a real image; resize or convert it"


def _idx(path: Path, dims: tuple[int, ...], body: bytes, *, gz: bool = False) -> Path:
    data = bytes([0, 0, 8, len(dims)]) + b"".join(d.to_bytes(4, "big") for d in dims) + body
    path.write_bytes(gzip.compress(data, compresslevel=1) if gz else data)
    return path


def _mnist_folder(tmp_path: Path, dims: tuple[int, ...], body: bytes = bytes(16), **kw) -> Path:
    folder = tmp_path / "idx"
    folder.mkdir()
    _idx(folder / "train-images-idx3-ubyte", dims, body, **kw)
    _idx(folder / "train-labels-idx1-ubyte", (2,), bytes(2))
    return folder


@pytest.mark.parametrize("dims, line", [
    ((4_000_000_000, 28, 28), "images = 4000000000 is outside 1..16777216"),
    ((10, 40_000, 28), "height = 40000 is outside 1..32768"),
    ((10, 0, 28), "height = 0 is outside 1..32768"),
])
def test_a_forged_idx_header_is_refused_by_the_cli(tmp_path, cli, dims, line):
    folder = _mnist_folder(tmp_path, dims)
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}
    rc, _, err = cli(["conserve", "run", "--task", "vit", "--images", folder, "--out", tmp_path / "out",
                      "--steps", "1", "--seeds", "1", "--regime", "gd", "--lr", "0.1"])
    path = folder / "train-images-idx3-ubyte"
    assert rc == 2 and err.strip() == (f"flowgeom: error: IDX file {path} {line} (no real image set is that "
                                       f"size); {IDX_FIX}")
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()} == before
    assert not list((tmp_path / "out").rglob("metrics.jsonl"))  # nothing was trained on it


def test_one_idx_image_over_the_value_limit(tmp_path):
    folder = _mnist_folder(tmp_path, (1, 9000, 9000))
    with pytest.raises(FlowgeomError) as info:
        load_mnist("train", path=folder)
    assert str(info.value) == (f"IDX file {folder / 'train-images-idx3-ubyte'}: one image of shape (9000, 9000) "
                               f"holds 81000000 values, over 67108864 (no real image is that large); {IDX_FIX}")


def test_idx_with_the_wrong_number_of_dimensions(tmp_path):
    folder = _mnist_folder(tmp_path, (2, 28))
    with pytest.raises(FlowgeomError, match=r"has shape \(2, 28\); expected \(images, height, width\)"):
        load_mnist("train", path=folder)


def test_a_gzip_stream_longer_than_its_header_is_not_inflated(tmp_path):
    """A 64 MB stream of zeros behind a header for 2 images of 4 x 4: refused after reading 33 bytes of it."""
    folder = _mnist_folder(tmp_path, (2, 4, 4), bytes(64 << 20), gz=True)
    (folder / "train-images-idx3-ubyte").rename(folder / "train-images-idx3-ubyte.gz")
    with pytest.raises(FlowgeomError) as info:
        load_mnist("train", path=folder)
    assert str(info.value) == (f"{folder / 'train-images-idx3-ubyte.gz'} holds more data than its header says "
                               "((2, 4, 4), 32 bytes); re-download it")


def test_a_truncated_idx_header(tmp_path):
    folder = tmp_path / "idx"
    folder.mkdir()
    (folder / "train-images-idx3-ubyte").write_bytes(bytes([0, 0, 8, 3, 0, 0]))
    with pytest.raises(FlowgeomError, match="is truncated inside its header"):
        load_mnist("train", path=folder)


# -- image folders: .npy, .png, .pt -------------------------------------------------------------------

def _npy(path: Path, shape: tuple[int, ...], body: bytes, dtype: str = "|u1") -> Path:
    header = repr({"descr": dtype, "fortran_order": False, "shape": shape}).encode()
    header += b" " * (63 - (10 + len(header)) % 64) + b"\n"
    path.write_bytes(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header + body)
    return path


def _image_folder(tmp_path: Path, name: str) -> tuple[Path, Path]:
    folder = tmp_path / "imgs"
    (folder / "cat").mkdir(parents=True)
    np.save(folder / "cat" / "a.npy", np.zeros((8, 8), np.uint8))  # a real image next to the forged one
    return folder, folder / "cat" / name


@pytest.mark.parametrize("shape, message", [
    ((3, 9000, 9000), "one image of shape (3, 9000, 9000) holds 243000000 values, over 67108864 (no real image "
                      f"is that large); {IMAGE_FIX}"),
    ((40_000, 40_000), f"height = 40000 is outside 1..32768 (no real image set is that size); {IMAGE_FIX}"),
    ((2, 3, 4, 5), f"has shape (2, 3, 4, 5); expected (channels, height, width); {IMAGE_FIX}"),
])
def test_a_forged_npy_image_header(tmp_path, shape, message):
    folder, path = _image_folder(tmp_path, "b.npy")
    _npy(path, shape, bytes(16))
    with pytest.raises(FlowgeomError) as info:
        load_image_folder(folder)
    sep = ": " if message.startswith("one image") else " "
    assert str(info.value) == f"image file {path}{sep}{message}"


def test_an_npy_header_larger_than_its_file(tmp_path):
    folder, path = _image_folder(tmp_path, "b.npy")
    _npy(path, (8, 8), bytes(10))
    with pytest.raises(FlowgeomError) as info:
        load_image_folder(folder)
    assert str(info.value) == (f"image file {path} declares (8, 8) uint8 (64 bytes) but holds 10 bytes of data; "
                               "pass a folder of regular image files")


def test_an_npy_of_python_objects_is_not_unpickled(tmp_path):
    folder, path = _image_folder(tmp_path, "b.npy")
    np.save(path, np.array([object()] * 4, dtype=object).reshape(2, 2), allow_pickle=True)
    with pytest.raises(FlowgeomError, match=r"holds Python objects \(dtype object\)"):
        load_image_folder(folder)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _png_header(width: int, height: int) -> bytes:
    """An RGB PNG whose IHDR (valid CRC) declares ``width x height``, with 9 bytes of pixels: a forged file."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(bytes(9)))
            + _chunk(b"IEND", b""))


def test_a_png_declaring_a_huge_picture_is_refused_before_decoding(tmp_path):
    pytest.importorskip("PIL")
    folder, path = _image_folder(tmp_path, "b.png")
    path.write_bytes(_png_header(5000, 5000))
    with pytest.raises(FlowgeomError) as info:
        load_image_folder(folder)
    assert str(info.value) == (f"image file {path}: one image of shape (3, 5000, 5000) holds 75000000 values, over "
                               f"67108864 (no real image is that large); {IMAGE_FIX}")


def test_a_pt_that_is_not_a_torch_file(tmp_path):
    folder, path = _image_folder(tmp_path, "b.pt")
    path.write_bytes(b"not a zip at all")
    with pytest.raises(FlowgeomError, match=f"image file {path} is not a torch.save file"):
        load_image_folder(folder)


def test_a_cifar_pickle_asking_for_a_huge_placeholder(tmp_path):
    raw = pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 1]}, protocol=4)
    placeholder = b"ndarray\x94\x93\x94K\x00\x85"  # _reconstruct(ndarray, (0,), b'b'): what numpy writes
    assert raw.count(placeholder) == 1
    raw = raw.replace(placeholder, b"ndarray\x94\x93\x94J\xff\xff\xff\x7f\x85")  # shape (2**31 - 1,)
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        (folder / name).write_bytes(raw)
    with pytest.raises(FlowgeomError) as info:
        load_cifar10(folder)
    assert str(info.value) == (f"{folder / 'data_batch_1'} was refused and not unpickled: it asks numpy for a "
                               "placeholder array of shape (2147483647,) (numpy writes (0,)); pass the official "
                               "CIFAR-10 python batches")
