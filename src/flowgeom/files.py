"""Reading files from other people: regular files only, opened without blocking.

Every file flowgeom reads (checkpoints, ``config.json``, ``adapter_config.json``,
a run's ``metrics.jsonl``, a sweep's ``manifest.json``, CIFAR batches) comes
through :func:`open_regular` or :func:`read_regular`:

* :func:`regular_file` ``stat``\\ s the path (symlinks followed) *before* any
  open and refuses a FIFO (``open`` blocks until a writer appears: forever), a
  character device (``/dev/zero`` never ends), a block device, a socket or a
  folder, with one line naming what it is; dangling and looping symlinks get
  their own message.
* :func:`open_regular` opens with ``O_NONBLOCK`` (a FIFO swapped in after the
  ``stat`` cannot block the open) and re-checks the open descriptor with
  ``fstat``.
* :func:`read_regular` reads at most ``limit`` bytes and refuses a longer file,
  so a 100 GB "config" is not read into memory.
* :func:`read_npy` reads a ``.npy`` array (an image, a token cache entry)
  after checking its header against the file's size and a shape contract.

This module sits below everything (it imports only :mod:`flowgeom.errors`).
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
from collections.abc import Callable
from pathlib import Path

from flowgeom.errors import FlowgeomError, shown

CHECKPOINT_FIX = "pass the checkpoint file itself"
_CHUNK = 2**24  # bytes per read
MAX_JSON = 64 * 2**20  # bytes of a config/adapter/manifest JSON file (real ones are a few kB)
_KINDS = {stat.S_IFDIR: "a folder", stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket"}


def file_kind(mode: int) -> str:
    """What a non-regular file of ``st_mode`` ``mode`` is, for messages ("a FIFO (named pipe)", "a folder", ...)."""
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def one_line(exc: BaseException) -> str:
    """A library exception's text on one line (what a reader said, without its newlines)."""
    return " ".join(str(exc).split()) or type(exc).__name__


def regular_file(path: Path, what: str, *, folder_ok: bool = False, fix: str = CHECKPOINT_FIX) -> os.stat_result:
    """``stat`` of ``path`` (symlinks followed), refusing anything but a regular file (or a folder if allowed).

    ``what`` names the file in messages ("config.json"); ``fix`` ends the
    message for a non-regular file.
    """
    try:
        info = os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):
            raise FlowgeomError(f"{what} {shown(path)} is a dangling symlink (it points to "
                                f"{shown(os.readlink(path))}, which does not exist); fix or remove the link") from None
        if fix != CHECKPOINT_FIX:
            raise FlowgeomError(f"{what} {shown(path)} does not exist; {fix}") from None
        raise FlowgeomError(f"no such file or folder: {shown(path)}; pass a .safetensors/.gguf file, a model folder, "
                            "or builtin:smollm2 / builtin:minilm") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise FlowgeomError(f"{what} {shown(path)} is a symlink loop (it never reaches a file); "
                                "fix or remove the link") from None
        raise FlowgeomError(f"cannot access {what} {shown(path)} ({one_line(exc)}); check the path and its "
                            "permissions") from None
    except ValueError as exc:  # embedded NUL byte
        raise FlowgeomError(f"{what} path {shown(path)} is not a valid path ({one_line(exc)})") from None
    if stat.S_ISREG(info.st_mode) or (folder_ok and stat.S_ISDIR(info.st_mode)):
        return info
    kind = file_kind(info.st_mode)
    raise FlowgeomError(f"{what} {shown(path)} is {kind}, not a regular file; it was not opened (reading a FIFO "
                        f"or device can block forever): {fix}")


def open_regular(path: Path, what: str, *, fix: str = CHECKPOINT_FIX):
    """Binary file object of regular file ``path``; the open never blocks (O_NONBLOCK), ``fstat`` re-checks it."""
    regular_file(path, what, fix=fix)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise FlowgeomError(f"cannot open {what} {shown(path)} ({one_line(exc)}); check its permissions") from None
    fh = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped between stat and open
        fh.close()
        raise FlowgeomError(f"{what} {shown(path)} changed into a non-regular file while being opened; retry")
    return fh


def read_regular(path: str | os.PathLike, what: str, *, fix: str, limit: int = MAX_JSON) -> bytes:
    """All bytes of regular file ``path``, refusing non-regular files and files over ``limit`` bytes."""
    path = Path(path)
    too_big = f"{what} {shown(path)} is over {limit} bytes, far larger than such a file can be; {fix}"
    with open_regular(path, what, fix=fix) as fh:
        if os.fstat(fh.fileno()).st_size > limit:
            raise FlowgeomError(too_big)
        chunks, total = [], 0
        try:
            while total <= limit:  # in chunks: read(limit + 1) would allocate the whole limit up front
                chunk = fh.read(min(_CHUNK, limit + 1 - total))
                if not chunk:
                    break
                chunks.append(chunk)
                total += len(chunk)
        except OSError as exc:
            raise FlowgeomError(f"cannot read {what} {shown(path)} ({one_line(exc)}); {fix}") from None
    if total > limit:  # it grew while being read
        raise FlowgeomError(too_big)
    return b"".join(chunks)


def read_text(path: str | os.PathLike, what: str, *, fix: str, limit: int = MAX_JSON) -> str:
    """:func:`read_regular` decoded as UTF-8 (one-line :class:`FlowgeomError` if it is not)."""
    raw = read_regular(path, what, fix=fix, limit=limit)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FlowgeomError(f"{what} {shown(path)} is not UTF-8 text ({one_line(exc)}); {fix}") from None


def read_json_object(path: str | os.PathLike, *, fix: str, what: str | None = None,
                     limit: int = MAX_JSON) -> dict:
    """The JSON object in regular file ``path``; one-line :class:`FlowgeomError` (ending with ``fix``) otherwise."""
    path = Path(path)
    what = what or path.name
    text = read_text(path, what, fix=fix, limit=limit)
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, int too long, nesting
        raise FlowgeomError(f"{what} {shown(path)} is not readable JSON ({one_line(exc)[:200]}); {fix}") from None
    if not isinstance(value, dict):
        raise FlowgeomError(f"{what} {shown(path)} holds a JSON {type(value).__name__}, not an object; {fix}")
    return value


def read_npy(path: str | os.PathLike, what: str, *, fix: str, limit: int,
             check: Callable[[tuple[int, ...]], object] | None = None):
    """The numpy array in ``.npy`` file ``path``, its header checked before the data is read.

    ``np.load`` trusts the header: it allocates ``prod(shape)`` items and only then finds the file short, so
    a 100-byte file can ask for terabytes. Here the declared dtype must be numeric (an object array is a
    pickle), the declared bytes must be exactly the bytes that follow the header, the file at most ``limit``
    bytes, and ``check(shape)`` (a size contract, e.g. :func:`flowgeom.limits.image_shape`) runs first.
    """
    import numpy as np
    from numpy.lib import format as npy

    path = Path(path)
    with open_regular(path, what, fix=fix) as fh:
        size = os.fstat(fh.fileno()).st_size
        if size > limit:
            raise FlowgeomError(f"{what} {shown(path)} is over {limit} bytes, far larger than such a file can be; "
                                f"{fix}")
        try:
            version = npy.read_magic(fh)
            header = {(1, 0): npy.read_array_header_1_0, (2, 0): npy.read_array_header_2_0}.get(version)
            if header is None:
                raise ValueError(f"unsupported .npy format version {version}")
            shape, fortran, dtype = header(fh)
        except (ValueError, SyntaxError, OSError) as exc:
            raise FlowgeomError(f"{what} {shown(path)} is not a .npy array ({one_line(exc)[:200]}); {fix}") from None
        if dtype.hasobject:
            raise FlowgeomError(f"{what} {shown(path)} holds Python objects (dtype {dtype}), which only a pickle can "
                                f"load; it was refused: {fix}")
        if check is not None:
            check(shape)
        count = math.prod(shape)
        if count * dtype.itemsize != size - fh.tell():
            raise FlowgeomError(f"{what} {shown(path)} declares {shape} {dtype} ({count * dtype.itemsize} bytes) but "
                                f"holds {size - fh.tell()} bytes of data; {fix}")
        array = np.fromfile(fh, dtype=dtype, count=count)
    return array.reshape(shape, order="F" if fortran else "C")
