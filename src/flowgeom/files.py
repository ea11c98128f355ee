"""Files from other people, and folders they may touch: reading regular files only, writing never through a link.

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

Every file flowgeom writes goes through :func:`atomic_write` (whole files) or
:func:`open_append` (line logs); see "output paths" below.

This module sits below everything (it imports only :mod:`flowgeom.errors`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import secrets
import stat
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, BinaryIO, TextIO

from flowgeom.errors import FlowgeomError, RefusedInput, shown

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
            raise RefusedInput(f"{what} {shown(path)} is a dangling symlink (it points to "
                                f"{shown(os.readlink(path))}, which does not exist); fix or remove the link") from None
        if fix != CHECKPOINT_FIX:
            raise FlowgeomError(f"{what} {shown(path)} does not exist; {fix}") from None
        raise FlowgeomError(f"no such file or folder: {shown(path)}; pass a .safetensors/.gguf file, a model folder, "
                            "or builtin:smollm2 / builtin:minilm") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise RefusedInput(f"{what} {shown(path)} is a symlink loop (it never reaches a file); "
                                "fix or remove the link") from None
        raise FlowgeomError(f"cannot access {what} {shown(path)} ({one_line(exc)}); check the path and its "
                            "permissions") from None
    except ValueError as exc:  # embedded NUL byte
        raise FlowgeomError(f"{what} path {shown(path)} is not a valid path ({one_line(exc)})") from None
    if stat.S_ISREG(info.st_mode) or (folder_ok and stat.S_ISDIR(info.st_mode)):
        return info
    kind = file_kind(info.st_mode)
    raise RefusedInput(f"{what} {shown(path)} is {kind}, not a regular file; it was not opened (reading a FIFO "
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


def _is_checkpoint(path: Path) -> bool:
    """Whether ``path`` starts like a GGUF or safetensors file (magic ``GGUF``; u64 header length, then ``{``)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(9)
    except OSError:
        return False
    return head[:4] == b"GGUF" or (len(head) == 9 and head[8:9] == b"{"
                                   and 2 <= int.from_bytes(head[:8], "little") <= path.stat().st_size - 8)


# ---------------------------------------------------------------- output paths
#
# Every file flowgeom writes goes through :func:`atomic_write` (whole files) or :func:`open_append` (metrics
# lines, CSV rows). Both take the folder being written (``root``: a run folder, ``--out``, ``--export``; by
# default the file's own folder) and
#
# * refuse an output that is, or lies inside, one of ``inputs`` (symlinks resolved);
# * walk from ``root`` down with one descriptor per folder, opening each with ``O_NOFOLLOW`` (and creating
#   missing ones), so a symlink planted below ``root`` is refused, never followed, even if it appears after a
#   check; ``root`` itself is the user's choice and may be a link;
# * refuse a symlink at the file itself, and create the temporary file ``O_EXCL | O_NOFOLLOW`` next to it,
#   then ``rename`` it over the file (rename replaces a name, it never writes through one).

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIRECTORY = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC


def _folder_error(flag: str, path: Path) -> FlowgeomError:
    return FlowgeomError(f"{flag} {path} is a folder; {flag} takes a file name, e.g. {path / 'report.json'}")


def _link_error(what: str, path: Path, link: Path, root: Path) -> RefusedInput:
    try:
        target = os.readlink(link)
    except OSError:  # removed meanwhile
        target = "?"
    return RefusedInput(f"{what} {path} goes through the symlink {link} (-> {target}); flowgeom never writes "
                        f"through a link out of {root}: remove the link")


def _write_error(what: str, path: Path, exc: OSError) -> FlowgeomError:
    fix = "free disk space" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "choose a writable location"
    return FlowgeomError(f"cannot write {what} {path}: {exc.strerror or exc}; {fix}")


def _refuse_inputs(path: Path, flag: str, inputs: Iterable[str | os.PathLike]) -> None:
    """Refuse an output ``path`` that is one of ``inputs`` or lies inside an input folder (symlinks resolved).

    The folder of a sharded index (``*.index.json``) counts as an input folder: its shards are read too.
    """
    target = Path(os.path.realpath(path))
    for given in inputs:
        if str(given).startswith("builtin:") or not os.path.lexists(given):
            continue
        source = Path(os.path.realpath(given))
        folders = [source] if source.is_dir() else [source.parent] if source.name.endswith(".index.json") else []
        if target == source:
            raise FlowgeomError(f"{flag} {path} is the input {given}: writing it would replace what is being read; "
                                f"choose another {flag}")
        for folder in folders:
            if target.is_relative_to(folder):
                raise FlowgeomError(f"{flag} {path} lies inside the input folder {folder}: writing there could "
                                    f"replace what is being read; choose another {flag} outside it")


def check_out_file(path: str | os.PathLike, flag: str = "--out", *,
                   inputs: Iterable[str | os.PathLike] = ()) -> None:
    """Refuse, before any work, an output file path that cannot be written: a folder, or under a file.

    ``inputs`` (the files and folders the command reads) are compared with symlinks resolved: an output that
    is an input, or lies inside an input folder (or the folder of a sharded index), is refused, so a report
    can never replace the weights it describes. A user flag (``--out``, ``--figure``) onto an existing file
    that starts like a safetensors or GGUF checkpoint is refused whatever the inputs. :func:`atomic_write`
    checks the inputs again when it writes.
    """
    path = Path(path)
    if path.is_dir():
        raise _folder_error(flag, path)
    _refuse_inputs(path, flag, inputs)
    if path.is_symlink():  # refused here, before the work, as atomic_write would refuse it after
        raise _link_error(flag, path, path, path.parent)
    if flag.startswith("--") and path.is_file() and _is_checkpoint(path):  # (a link was refused above)
        raise FlowgeomError(f"{flag} {path} is an existing model checkpoint; {flag} writes a report and would "
                            f"replace the weights: choose another {flag}")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise FlowgeomError(f"{flag} {path}: {parent} is a file, not a folder; choose another {flag}")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise FlowgeomError(f"{flag} {path}: the folder {parent} is not writable; choose another {flag}")
            return


def _below(root: Path, path: Path, what: str) -> tuple[str, ...]:
    """The parts of ``path`` below ``root``; refused when ``path`` is not strictly inside ``root``."""
    try:
        parts = path.relative_to(root).parts
    except ValueError:
        parts = ()
    if not parts or ".." in parts:
        raise RefusedInput(f"{what} {path} is not inside {root}; flowgeom writes only inside it")
    return parts


def confined(root: str | os.PathLike, path: str | os.PathLike, what: str = "the output") -> Path:
    """``path`` under ``root``, refused when any component below ``root`` (``path`` included) is a symlink.

    A check only, for moves and deletions (a sweep's ``rejected/``); writes walk the folders themselves
    (:func:`atomic_write`). ``root`` itself may be a link the user chose.
    """
    root, path = Path(root), Path(path)
    current = root
    for part in _below(root, path, what):
        current = current / part
        if current.is_symlink():
            raise _link_error(what, path, current, root)
    return path


def _open_folder(root: Path, parts: tuple[str, ...], *, path: Path, what: str) -> int:
    """A descriptor of ``root/parts...``, creating missing folders; a symlink below ``root`` is refused.

    Each step opens the next folder relative to the previous descriptor with ``O_NOFOLLOW``, so no link
    swapped in between a check and the write can lead out of ``root``.
    """
    try:
        root.mkdir(parents=True, exist_ok=True)  # the user's own path: links there are theirs
        fd = os.open(root, _DIRECTORY)
    except FileExistsError:
        raise FlowgeomError(f"{what} {path}: {root} is a file, not a folder; choose another location") from None
    except OSError as exc:
        raise _write_error(what, path, exc) from None
    here = root
    try:
        for part in parts:
            here = here / part
            try:
                os.mkdir(part, 0o777, dir_fd=fd)
            except FileExistsError:
                pass
            try:
                child = os.open(part, _DIRECTORY | _NOFOLLOW, dir_fd=fd)
            except OSError as exc:
                if os.path.islink(here):
                    raise _link_error(what, path, here, root) from None
                if exc.errno == errno.ENOTDIR:
                    raise FlowgeomError(f"{what} {path}: {here} is a file, not a folder; remove it or choose "
                                        "another location") from None
                raise _write_error(what, path, exc) from None
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def _output(path: str | os.PathLike, *, root: str | os.PathLike | None, inputs: Iterable[str | os.PathLike],
            what: str) -> tuple[Path, int, str, os.stat_result | None]:
    """``(path, folder descriptor, file name, lstat of the file or None)`` for a write; see "output paths"."""
    path = Path(path)
    root = path.parent if root is None else Path(root)
    parts = _below(root, path, what)
    _refuse_inputs(path, what, inputs)
    fd = _open_folder(root, parts[:-1], path=path, what=what)
    try:
        info = os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        return path, fd, parts[-1], None
    except OSError as exc:
        os.close(fd)
        raise _write_error(what, path, exc) from None
    if stat.S_ISLNK(info.st_mode) or stat.S_ISDIR(info.st_mode):
        os.close(fd)
        raise _link_error(what, path, path, root) if stat.S_ISLNK(info.st_mode) else _folder_error(what, path)
    return path, fd, parts[-1], info


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], object], *,
                 root: str | os.PathLike | None = None, inputs: Iterable[str | os.PathLike] = (),
                 what: str = "the output") -> Path:
    """Fill ``path`` through ``write(fh)`` (a binary file) so readers see the old or the new file only.

    The one way flowgeom writes a whole file: never through a symlink below ``root`` (default: the file's
    folder), never onto or inside ``inputs`` (see "output paths" above). Returns ``path``.
    """
    path, fd, name, _ = _output(path, root=root, inputs=inputs, what=what)
    tmp = f".{name}.{secrets.token_hex(6)}.tmp"
    try:
        try:
            out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o644, dir_fd=fd)
        except OSError as exc:
            raise _write_error(what, path, exc) from None
        try:
            with os.fdopen(out, "wb") as fh:
                write(fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
        except BaseException as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=fd)
            if isinstance(exc, OSError):
                raise _write_error(what, path, exc) from exc
            raise
    finally:
        os.close(fd)
    return path


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, root: str | os.PathLike | None = None,
                       inputs: Iterable[str | os.PathLike] = (), what: str = "the output") -> Path:
    """:func:`atomic_write` of ``data``."""
    return atomic_write(path, lambda fh: fh.write(data), root=root, inputs=inputs, what=what)


def atomic_write_figure(path: str | os.PathLike, fig: Any, *, root: str | os.PathLike | None = None,
                        inputs: Iterable[str | os.PathLike] = (), **savefig: Any) -> Path:
    """:func:`atomic_write` of a matplotlib figure, in the format its suffix names unless ``format=`` is given."""
    savefig.setdefault("format", Path(path).suffix.lstrip(".").lower() or "png")
    return atomic_write(path, lambda fh: fig.savefig(fh, **savefig), root=root, inputs=inputs, what="the figure")


def out_folder(root: str | os.PathLike, path: str | os.PathLike, what: str = "the output folder") -> Path:
    """Create folder ``path`` below ``root`` (parents too) without following a symlink below ``root``.

    For a folder handed to code that writes several files into it (a run's ``figures/``, a claim's figures).
    """
    root, path = Path(root), Path(path)
    os.close(_open_folder(root, _below(root, path, what), path=path, what=what))
    return path


def open_append(path: str | os.PathLike, *, root: str | os.PathLike | None = None,
                newline: str | None = None) -> TextIO:
    """``path`` opened for appending UTF-8 text (created if missing), never through a symlink below ``root``.

    A FIFO, device or socket in its place is refused (appending to one blocks or never lands in a file).
    """
    what = "the output"
    path, fd, name, info = _output(path, root=root, inputs=(), what=what)
    try:
        if info is not None and not stat.S_ISREG(info.st_mode):
            raise RefusedInput(f"{path} is {file_kind(info.st_mode)}, not a regular file; remove it and run again")
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | _CLOEXEC
        try:
            out = os.open(name, flags, 0o644, dir_fd=fd)
        except OSError as exc:
            raise _write_error(what, path, exc) from None
    finally:
        os.close(fd)
    if not stat.S_ISREG(os.fstat(out).st_mode):  # swapped in after the check
        os.close(out)
        raise RefusedInput(f"{path} changed into a non-regular file while being opened; remove it and run again")
    return os.fdopen(out, "a", encoding="utf-8", newline=newline)
