"""Tensors a compression keeps on disk between its stages, read back one block or one unit at a time.

Two intermediate results of ``compress run`` are each larger than the model they
come from: the calibration's Grams (float64; SmolLM2's 30 blocks hold 0.8 GB,
1.5x its float32 weights) and the full-rank factors whose components the loss
allocation scores (float32, 0.6 GB). Both are made and used one block (or one
unit) at a time, so each is written to disk when made and read back when used:
memory holds the model's weights and one block's worth of them.

* :class:`TensorFiles`: a folder of safetensors files, one per name, each
  written whole (atomically and synced when ``durable``: what will become a
  cache). ``TensorFiles.temporary()`` makes a private scratch folder under
  ``$FLOWGEOM_CACHE/scratch`` (default ``~/.cache/flowgeom``: on disk, where a
  system temp folder may be RAM), removed with the object or at exit;
  ``move(dest)`` renames a finished one into a cache, so a cache entry appears
  whole or not at all. The scratch folders of killed processes (named by
  their pid) are removed by the next ``temporary()``.
* :class:`GramFiles`: a calibration's Grams as a sequence over blocks,
  ``grams[l][key]`` (the :class:`~flowgeom.compress.calibrate.Calibration`
  interface), one file per block.
* :class:`FactorFiles`: factorisations (:class:`~flowgeom.compress.factorize.Factors`)
  as a sequence, one file per unit.

What is read back is, byte for byte, what was written: results do not depend on
where the tensors waited.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import weakref
from collections.abc import Sequence
from pathlib import Path

import torch

from flowgeom.errors import FlowgeomError


def cache_root() -> Path:
    """``$FLOWGEOM_CACHE``, default ``~/.cache/flowgeom``."""
    return Path(os.environ.get("FLOWGEOM_CACHE") or Path.home() / ".cache" / "flowgeom")


class TensorFiles:
    """``put(name, tensors, metadata)`` / ``get(name)`` on ``folder/<name>.safetensors``."""

    def __init__(self, folder: Path, *, durable: bool = True):
        self.folder = Path(folder)
        self.durable = durable  # atomic, fsynced writes (a cache); scratch files are written plainly
        self._remove: weakref.finalize | None = None  # a temporary folder's removal

    @classmethod
    def temporary(cls, *, durable: bool = False) -> TensorFiles:
        """A private scratch folder, removed when the returned object is collected (or at exit)."""
        root = cache_root() / "scratch"
        try:
            root.mkdir(parents=True, exist_ok=True)
            _sweep_dead(root)
            folder = tempfile.mkdtemp(dir=root, prefix=f"w{os.getpid()}.")
        except OSError:  # a read-only cache: the system's temp folder
            folder = tempfile.mkdtemp(prefix="flowgeom-")
        files = cls(Path(folder), durable=durable)
        files._remove = weakref.finalize(files, shutil.rmtree, folder, ignore_errors=True)
        return files

    def move(self, dest: Path) -> None:
        """Rename this (temporary) folder to ``dest``, replacing what is there, and keep it after the run."""
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        if dest.exists():  # an entry that did not match or parse
            shutil.rmtree(dest)
        os.rename(self.folder, dest)
        self.folder = dest
        if self._remove is not None:
            self._remove.detach()

    def path(self, name: str) -> Path:
        return self.folder / f"{name}.safetensors"

    def put(self, name: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
        from flowgeom.compress.write import stream_safetensors

        if self.durable:
            from flowgeom.files import atomic_write

            atomic_write(self.path(name), lambda fh: stream_safetensors(fh, tensors, metadata), root=self.folder)
        else:
            with open(self.path(name), "wb") as fh:
                stream_safetensors(fh, tensors, metadata)

    def get(self, name: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """``(tensors, metadata)`` of ``name``; a missing or unreadable file is one error naming it."""
        from safetensors import safe_open

        try:
            with safe_open(str(self.path(name)), framework="pt") as f:
                return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
        except Exception as exc:  # noqa: BLE001 - removed or damaged while in use
            raise FlowgeomError(f"{self.path(name)} could not be read back ({type(exc).__name__}); it was removed or "
                                "damaged while the compression ran: run it again") from None


def _sweep_dead(root: Path) -> None:
    """Remove the scratch folders ``w<pid>.*`` of processes no longer running (killed before their clean-up)."""
    from flowgeom.compress.write import _running

    for path in root.iterdir():
        pid = path.name[1:].split(".")[0]
        if path.name.startswith("w") and pid.isdigit() and int(pid) != os.getpid() and not _running(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


class GramFiles(Sequence):
    """A calibration's Grams on disk: ``grams[l]`` is block l's ``{key: (n, n) float64}``, read when indexed."""

    def __init__(self, files: TensorFiles, n_layers: int, key: str = ""):
        self.files, self.n_layers, self.key = files, n_layers, key

    def __len__(self) -> int:
        return self.n_layers

    def __getitem__(self, layer):
        if isinstance(layer, slice):
            return [self[l] for l in range(self.n_layers)[layer]]
        if not -self.n_layers <= layer < self.n_layers:
            raise IndexError(layer)
        return self.files.get(str(layer % self.n_layers))[0]

    def put(self, layer: int, grams: dict[str, torch.Tensor]) -> None:
        self.files.put(str(layer), grams, {"key": self.key, "layer": str(layer)})

    def check(self, keys: Sequence[str]) -> bool:
        """Every block's file is there, stored for :attr:`key`, with ``keys`` as finite float64 (read one block at
        a time)."""
        for l in range(self.n_layers):
            try:
                grams, meta = self.files.get(str(l))
            except FlowgeomError:
                return False
            if meta.get("key") != self.key or meta.get("layer") != str(l) or set(grams) != set(keys):
                return False
            if any(g.dtype != torch.float64 or not torch.isfinite(g).all() for g in grams.values()):
                return False
        return True


class FactorFiles(Sequence):
    """Factorisations on disk, one file per unit, read when indexed (``append`` writes the next one)."""

    def __init__(self, files: TensorFiles):
        self.files, self.count = files, 0

    def __len__(self) -> int:
        return self.count

    def append(self, f) -> None:
        tensors = {"basis": f.basis, "sigma": f.sigma, **{f"coeff.{i}": c for i, c in enumerate(f.coeffs)}}
        self.files.put(str(self.count), tensors, {"space": f.space, "shift": json.dumps(f.shift),
                                                  "layers": str(len(f.coeffs))})
        self.count += 1

    def __getitem__(self, i):
        from flowgeom.compress.factorize import Factors

        if isinstance(i, slice):
            return [self[j] for j in range(self.count)[i]]
        if not -self.count <= i < self.count:
            raise IndexError(i)
        tensors, meta = self.files.get(str(i % self.count))
        coeffs = tuple(tensors[f"coeff.{j}"] for j in range(int(meta["layers"])))
        return Factors(meta["space"], tensors["basis"], coeffs, tensors["sigma"], json.loads(meta["shift"]))
