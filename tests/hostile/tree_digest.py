"""sha256 of every regular file under a folder: what the hostile-input tests compare before and after a command.

Symlinks are left out (a planted link is the attack, not content); imported by the test modules of this folder.
"""

from __future__ import annotations

import hashlib
from pathlib import Path


def snapshot(root: Path, *, skip: tuple[str, ...] = ()) -> dict[str, str]:
    """``{relative path: sha256}``; folders named in ``skip`` (e.g. flowgeom's own token ``cache``) left out."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))
            if p.is_file() and not p.is_symlink() and not set(skip) & set(p.relative_to(root).parts)}
