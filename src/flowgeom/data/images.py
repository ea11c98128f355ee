"""Image classification sets from local files: MNIST, CIFAR-10, ImageNet-style folders.

- ``load_images("mnist")`` — the shipped MNIST (see :mod:`flowgeom.data.mnist`);
  a folder of MNIST IDX files is also accepted through ``load_mnist``.
- ``load_cifar10(path)`` — the official "CIFAR-10 python version" folder
  (``data_batch_1..5``, ``test_batch``: pickled dicts with ``b"data"``
  (N 3072) uint8 in channel-major order and ``b"labels"``). The batches are
  read by a restricted unpickler (:class:`_BatchUnpickler`) that builds only
  plain containers and numpy arrays of numbers, so a forged batch file cannot
  run code.
- ``load_image_folder(path)`` — ImageNet-style ``ROOT/[split/]CLASS/*``; each
  file is one image as ``.npy`` or ``.pt`` ((H, W), (H, W, C) or (C, H, W)
  uint8 array), or ``.png/.jpg/.jpeg/.JPEG`` when Pillow is installed.

Every loader returns images (N C H W) uint8 and labels (N,) int64.
"""

from __future__ import annotations

import codecs
import io
import pickle
from pathlib import Path

import numpy as np
import torch

from flowgeom.data.mnist import load_mnist
from flowgeom.errors import FlowgeomError, choice_error
from flowgeom.files import one_line, read_npy, read_regular, regular_file
from flowgeom.limits import image_shape

SPLITS = ("train", "test")
_CIFAR = {"train": tuple(f"data_batch_{i}" for i in range(1, 6)), "test": ("test_batch",)}
_ARRAYS = (".npy", ".pt")
_PICTURES = (".png", ".jpg", ".jpeg")
_MAX_BATCH = 2**30  # bytes; an official batch is 31 MB
_MAX_IMAGE_FILE = 2**29  # bytes of one image file (MAX_IMAGE_VALUES float64 values)
_FOLDER_FIX = "pass a folder of regular image files"


class _Forbidden(pickle.UnpicklingError):
    pass


def _numeric_dtype(*args):
    """``numpy.dtype`` for a pickle, refusing object dtypes (whose items would be arbitrary pickled objects)."""
    dtype = np.dtype(*args)
    if dtype.hasobject:
        raise _Forbidden(f"it asks for a numpy array of Python objects (dtype {dtype})")
    return dtype


def _latin1(text: str, encoding: str = "latin1") -> bytes:
    """``_codecs.encode`` as protocol-2 pickles use it for ``bytes`` (nothing else is encoded)."""
    if encoding != "latin1":
        raise _Forbidden(f"it calls _codecs.encode with encoding {encoding!r}")
    return codecs.encode(text, "latin1")


# The only globals a CIFAR-10 batch needs (Python 2 and 3 pickles, numpy 1 and 2, protocols 2-5).
_ALLOWED = {("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): _numeric_dtype, ("_codecs", "encode"): _latin1}


def _reconstruct(cls, shape, dtype_code):
    """numpy's ``_reconstruct``, for ``ndarray`` only (the pickle's own class argument is not trusted).

    numpy always pickles an empty placeholder here (shape ``(0,)``) and the data in ``__setstate__``, which
    checks the declared shape against the bytes it is given; a placeholder of any other size would be an
    allocation of whatever the file asks for, so it is refused.
    """
    if cls is not np.ndarray:
        raise _Forbidden("it reconstructs an array subclass")
    if not isinstance(shape, tuple) or shape != (0,):
        raise _Forbidden(f"it asks numpy for a placeholder array of shape {shape!r} (numpy writes (0,))")
    return np.ndarray.__new__(np.ndarray, shape, dtype_code)


def _frombuffer(buf, dtype, shape, order):
    """numpy's protocol-5 ``_frombuffer`` for a numeric dtype."""
    dtype = _numeric_dtype(dtype)
    return np.frombuffer(buf, dtype=dtype).reshape(shape, order=order).copy()


for _module in ("numpy.core.multiarray", "numpy._core.multiarray"):
    _ALLOWED[(_module, "_reconstruct")] = _reconstruct
for _module in ("numpy.core.numeric", "numpy._core.numeric"):
    _ALLOWED[(_module, "_frombuffer")] = _frombuffer


class _BatchUnpickler(pickle.Unpickler):
    """An unpickler that resolves only :data:`_ALLOWED` globals: dicts, lists, str, bytes, numbers, numeric arrays."""

    def find_class(self, module: str, name: str):
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise _Forbidden(f"it refers to {module}.{name}, which a CIFAR-10 batch never does "
                             "(a pickle that names other globals can run code)") from None

    def persistent_load(self, pid):
        raise _Forbidden("it uses persistent ids")


def _read_batch(path: Path) -> dict:
    """One CIFAR-10 python batch, unpickled without running code (else one-line :class:`FlowgeomError`)."""
    raw = read_regular(path, "CIFAR-10 batch", fix="pass the official CIFAR-10 python batches",
                       limit=_MAX_BATCH)
    try:
        batch = _BatchUnpickler(io.BytesIO(raw), encoding="bytes").load()
    except _Forbidden as exc:
        raise FlowgeomError(f"{path} was refused and not unpickled: {exc}; pass the official CIFAR-10 "
                            "python batches") from None
    except Exception as exc:  # truncated / not a pickle
        text = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise FlowgeomError(f"{path} is not a CIFAR-10 python batch ({text}); re-extract the archive") from None
    if not isinstance(batch, dict):
        raise FlowgeomError(f"{path} holds a {type(batch).__name__}, not a dict; it is not a CIFAR-10 python batch")
    return batch


def load_cifar10(path: str | Path, split: str = "train", *, limit: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """CIFAR-10 python batches: images (N 3 32 32) uint8, labels (N,) int64."""
    if split not in SPLITS:
        raise choice_error("split", split, SPLITS)
    folder = Path(path)
    if (folder / "cifar-10-batches-py").is_dir():
        folder = folder / "cifar-10-batches-py"
    files = [folder / n for n in _CIFAR[split]]
    missing = [f.name for f in files if not f.exists()]
    if missing:
        raise FlowgeomError(f"CIFAR-10 folder {folder} lacks {', '.join(missing)}; pass the extracted "
                            "'cifar-10-batches-py' folder of the python version")
    images, labels = [], []
    for f in files:
        batch = _read_batch(f)
        data, labs = batch.get(b"data"), batch.get(b"labels")
        if not isinstance(data, np.ndarray) or data.dtype.kind not in "biuf" or data.ndim != 2 \
                or data.shape[1] != 3072 or not isinstance(labs, (list, np.ndarray)) or len(labs) != len(data):
            raise FlowgeomError(f"{f} has no (N, 3072) b'data' with N b'labels'; it is not a CIFAR-10 python batch")
        image_shape((len(data),), ("images",), where=f"CIFAR-10 batch {f}", fix="pass the official CIFAR-10 batches")
        labs = np.asarray(labs)
        if labs.dtype.kind not in "iu" or labs.ndim != 1 or (labs.size and (labs.min() < 0 or labs.max() > 9)):
            raise FlowgeomError(f"{f} has b'labels' that are not class ids 0..9; it is not a CIFAR-10 python batch")
        images.append(np.asarray(data, dtype=np.uint8).reshape(-1, 3, 32, 32))  # (N, C, H, W)
        labels.append(labs.astype(np.int64))
        if limit is not None and sum(len(x) for x in labels) >= limit:
            break
    x, y = np.concatenate(images), np.concatenate(labels)
    if limit is not None:
        x, y = x[:limit], y[:limit]
    return torch.from_numpy(x), torch.from_numpy(y)


def _layout(shape: tuple[int, ...]) -> str:
    """How an image array of ``shape`` is laid out: "HW", "HWC" (last axis 1 or 3, first not) or "CHW"."""
    if len(shape) == 2:
        return "HW"
    return "HWC" if len(shape) == 3 and shape[-1] in (1, 3) and shape[0] not in (1, 3) else "CHW"


def _check_image(path: Path, shape: tuple[int, ...]) -> None:
    """One image's declared shape against :data:`flowgeom.limits.IMAGE_LIMITS` (before its pixels are read)."""
    shape, layout = tuple(shape), _layout(tuple(shape))
    chw = (1, *shape) if layout == "HW" else (shape[2], shape[0], shape[1]) if layout == "HWC" else shape
    image_shape(chw, ("channels", "height", "width"), where=f"image file {path}",
                fix="expected (H, W), (H, W, C) or (C, H, W) of a real image; resize or convert it")


def _read_pt(path: Path) -> np.ndarray:
    """A ``.pt`` image (weights_only); the zip's declared sizes are checked before torch inflates anything."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as archive:
            declared = sum(info.file_size for info in archive.infolist())
    except (zipfile.BadZipFile, OSError) as exc:
        raise FlowgeomError(f"image file {path} is not a torch.save file ({one_line(exc)}); {_FOLDER_FIX}") from None
    if declared > _MAX_IMAGE_FILE:
        raise FlowgeomError(f"image file {path} unpacks to {declared} bytes, over {_MAX_IMAGE_FILE}; {_FOLDER_FIX}")
    try:
        arr = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - unpickling errors of every kind: the file is refused as a whole
        raise FlowgeomError(f"image file {path} could not be loaded as a tensor ({one_line(exc)[:200]}); "
                            f"{_FOLDER_FIX}") from None
    if not isinstance(arr, torch.Tensor) or arr.is_complex() or arr.dtype == torch.bool:
        raise FlowgeomError(f"image file {path} holds a {type(arr).__name__}, not a real-valued tensor; {_FOLDER_FIX}")
    _check_image(path, tuple(arr.shape))
    return arr.numpy()


def _read_picture(path: Path) -> np.ndarray:
    """A ``.png``/``.jpg`` through Pillow; its header's size is checked before the pixels are decoded."""
    try:
        from PIL import Image
    except ImportError:
        raise FlowgeomError(f"{path.name} is a {path.suffix} picture but Pillow is not installed; install "
                            "Pillow or convert the folder to .npy/.pt arrays") from None
    try:
        with Image.open(path) as im:
            width, height = im.size
            _check_image(path, (height, width, 3))
            return np.asarray(im.convert("RGB"))
    except FlowgeomError:
        raise
    except (OSError, ValueError, Image.DecompressionBombError) as exc:  # not a picture, truncated, a bomb
        raise FlowgeomError(f"image file {path} is not a readable picture ({one_line(exc)[:200]}); "
                            f"{_FOLDER_FIX}") from None


def _read_one(path: Path) -> np.ndarray:
    """One image file as (C, H, W) uint8, its size checked against the image contract before it is read."""
    suffix = path.suffix.lower()
    info = regular_file(path, "image file", fix=_FOLDER_FIX)
    if info.st_size > _MAX_IMAGE_FILE:
        raise FlowgeomError(f"image file {path} is {info.st_size} bytes, over {_MAX_IMAGE_FILE}; {_FOLDER_FIX}")
    if suffix == ".npy":
        arr = read_npy(path, "image file", fix=_FOLDER_FIX, limit=_MAX_IMAGE_FILE,
                       check=lambda shape: _check_image(path, shape))
    elif suffix == ".pt":
        arr = _read_pt(path)
    else:
        arr = _read_picture(path)
    if arr.dtype.kind not in "biuf":
        raise FlowgeomError(f"image file {path} holds {arr.dtype} values, not numbers; {_FOLDER_FIX}")
    layout = _layout(arr.shape)  # 2-D or 3-D: _check_image refused the rest
    arr = arr[None] if layout == "HW" else arr.transpose(2, 0, 1) if layout == "HWC" else arr  # (C, H, W)
    return arr.astype(np.uint8, copy=False)


def load_image_folder(path: str | Path, split: str = "train", *, limit: int | None = None,
                      classes: list[str] | None = None) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """ImageNet-style ``ROOT/[split/]CLASS/FILE``: images (N C H W) uint8, labels (N,), class names.

    Classes are the sorted sub-folder names (or ``classes``, to keep the
    train and test label ids aligned); all images must share one shape.
    """
    root = Path(path)
    if (root / split).is_dir():
        root = root / split
    if not root.is_dir():
        raise FlowgeomError(f"image folder {root} does not exist; pass ROOT holding [split/]CLASS/ sub-folders")
    names = classes or sorted(p.name for p in root.iterdir() if p.is_dir())
    if not names:
        raise FlowgeomError(f"{root} has no class sub-folders; expected ROOT/[split/]CLASS/*.npy|.pt|.png")
    items = [(f, c) for c, name in enumerate(names) if (root / name).is_dir()
             for f in sorted((root / name).iterdir()) if f.suffix.lower() in _ARRAYS + _PICTURES]
    if not items:
        raise FlowgeomError(f"no .npy/.pt/.png/.jpg files under {root}/CLASS/")
    if limit is not None:
        items = items[:limit]
    arrays = [_read_one(f) for f, _ in items]
    shapes = {a.shape for a in arrays}
    if len(shapes) > 1:
        raise FlowgeomError(f"images under {root} have different shapes {sorted(shapes)[:3]}; resize them to one shape")
    x = torch.from_numpy(np.stack(arrays))  # (N, C, H, W)
    y = torch.tensor([c for _, c in items], dtype=torch.long)
    return x, y, names


def load_images(source: str = "mnist", split: str = "train", *, limit: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch: ``"mnist"`` (shipped), or a folder: CIFAR-10 python batches, MNIST IDX, or class folders."""
    if source == "mnist":
        x, y = load_mnist(split, limit=limit)
        return x.unsqueeze(1), y  # (N, 1, 28, 28)
    folder = Path(source)
    if not folder.is_dir():
        raise FlowgeomError(f"image source {source!r} is neither 'mnist' nor an existing folder")
    if (folder / "test_batch").exists() or (folder / "cifar-10-batches-py").is_dir():
        return load_cifar10(folder, split, limit=limit)
    if any(folder.glob("*idx3-ubyte*")):
        x, y = load_mnist(split, path=folder, limit=limit)
        return x.unsqueeze(1), y
    x, y, _ = load_image_folder(folder, split, limit=limit)
    return x, y
