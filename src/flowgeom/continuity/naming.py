"""Map checkpoint tensor names to projection roles ``q k v o gate up down``.

Each naming scheme is a list of :class:`RolePattern` (a regex whose group
``layer`` is the block index). Every matrix is returned in the ``(out, in)``
layout of ``nn.Linear``:

* ``llama`` (Llama, Mistral, Qwen, flowgeom.nn zoo): ``….<L>.….q_proj.weight`` …
  ``down_proj.weight``; the layer is the first all-digit name segment.
* ``gguf`` (llama.cpp): ``blk.<L>.attn_q.weight`` … ``ffn_down.weight``. GGUF
  stores Q/K rows permuted for its RoPE layout; the permutation is the same in
  every layer, so cross-layer |cos| is unchanged.
* ``bert``: ``layer.<L>.attention.self.query/key/value``, ``attention.output.dense``
  (o), ``intermediate.dense`` (up), ``output.dense`` (down).
* ``gpt2``: ``h.<L>.attn.c_attn`` is Conv1D ``(in, 3 out)``: transposed, then
  rows split into q, k, v; ``attn.c_proj`` (o), ``mlp.c_fc`` (up), ``mlp.c_proj``
  (down), all transposed.

Grouped-query attention needs nothing special: k and v simply have fewer rows.
Unknown naming: pass ``custom={"name": regex}`` (CLI ``--role NAME=REGEX``),
the regex's first group (or group ``layer``) being the layer index.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from flowgeom.errors import FlowgeomError

ROLES = ("q", "k", "v", "o", "gate", "up", "down")
_LAYER = r"^(?:.*?\.)?(?P<layer>\d+)\.(?:.*\.)?"


@dataclass(frozen=True)
class RolePattern:
    """``regex`` matches a tensor name; ``transpose`` for (in, out) storage; ``split=(i, parts)`` takes row block i."""

    role: str
    regex: str
    transpose: bool = False
    split: tuple[int, int] | None = None


def _llama() -> list[RolePattern]:
    names = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
             "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
    return [RolePattern(r, _LAYER + re.escape(n) + r"\.weight$") for r, n in names.items()]


SCHEMES: dict[str, list[RolePattern]] = {
    "llama": _llama(),
    "gguf": [RolePattern(r, rf"^blk\.(?P<layer>\d+)\.{n}\.weight$") for r, n in
             (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("o", "attn_output"),
              ("gate", "ffn_gate"), ("up", "ffn_up"), ("down", "ffn_down"))],
    "bert": [RolePattern(r, rf"(?:^|\.)layer\.(?P<layer>\d+)\.{n}\.weight$") for r, n in
             (("q", r"attention\.self\.query"), ("k", r"attention\.self\.key"), ("v", r"attention\.self\.value"),
              ("o", r"attention\.output\.dense"), ("up", r"intermediate\.dense"), ("down", r"output\.dense"))],
    "gpt2": [RolePattern(r, rf"(?:^|\.)h\.(?P<layer>\d+)\.attn\.c_attn\.weight$", True, (i, 3))
             for i, r in enumerate(("q", "k", "v"))]
    + [RolePattern(r, rf"(?:^|\.)h\.(?P<layer>\d+)\.{n}\.weight$", True) for r, n in
       (("o", r"attn\.c_proj"), ("up", r"mlp\.c_fc"), ("down", r"mlp\.c_proj"))],
}


@dataclass(frozen=True)
class MatrixRef:
    """One projection matrix: which tensor, how to view it as (out, in), its final shape."""

    role: str
    layer: int
    tensor: str
    shape: tuple[int, int]
    transpose: bool = False
    split: tuple[int, int] | None = None

    def extract(self, t: torch.Tensor) -> torch.Tensor:
        """The (out, in) matrix from the stored tensor ``t``."""
        if self.transpose:
            t = t.mT
        if self.split is not None:
            i, parts = self.split
            rows = t.shape[0] // parts
            t = t[i * rows:(i + 1) * rows]  # (out/parts, in)
        return t


@dataclass(frozen=True)
class RoleLayout:
    """The matrices of every role, sorted by layer; ``scheme`` names the naming map used."""

    scheme: str
    roles: dict[str, list[MatrixRef]]


def parse_role_option(text: str) -> tuple[str, str]:
    """``"NAME=REGEX"`` -> (name, regex), checking the regex compiles and has a layer group."""
    name, sep, regex = text.partition("=")
    if not sep or not name or not regex:
        raise FlowgeomError(f"--role {text!r} must look like NAME=REGEX, e.g. --role 'q=blocks\\.(\\d+)\\.wq\\.weight'")
    try:
        compiled = re.compile(regex)
    except re.error as exc:
        raise FlowgeomError(f"--role {name}: regex {regex!r} does not compile ({exc}); fix the pattern") from exc
    if compiled.groups < 1:
        raise FlowgeomError(f"--role {name}: regex {regex!r} needs a group capturing the layer index, e.g. (\\d+)")
    return name, regex


def _match(patterns: Sequence[RolePattern], shapes: Mapping[str, tuple[int, ...]]) -> dict[str, dict[int, list[MatrixRef]]]:
    found: dict[str, dict[int, list[MatrixRef]]] = {}
    compiled = [(p, re.compile(p.regex)) for p in patterns]
    for name, shape in shapes.items():
        for pat, rx in compiled:
            hit = rx.search(name)
            if not hit:
                continue
            group = hit.group("layer") if "layer" in rx.groupindex else hit.group(1)
            if group is None or not group.isdigit():
                raise FlowgeomError(f"role {pat.role}: the layer group of {pat.regex!r} matched {group!r} in {name}, "
                                    "not a layer number; capture only the digits")
            layer = int(group)
            ref = MatrixRef(pat.role, layer, name, _view_shape(name, shape, pat), pat.transpose, pat.split)
            found.setdefault(pat.role, {}).setdefault(layer, []).append(ref)
    return found


def _view_shape(name: str, shape: tuple[int, ...], pat: RolePattern) -> tuple[int, int]:
    if len(shape) != 2:
        raise FlowgeomError(f"tensor {name} (role {pat.role}) has shape {list(shape)}, not a matrix; "
                            "fix the --role pattern so it matches only 2-D weights")
    out, inp = (shape[1], shape[0]) if pat.transpose else shape
    if pat.split is not None:
        if out % pat.split[1]:
            raise FlowgeomError(f"fused tensor {name} has {out} output rows, not divisible into {pat.split[1]} parts")
        out //= pat.split[1]
    return (out, inp)


def _listing(names: Sequence[str], limit: int = 25) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", … ({len(names) - limit} more)" if len(names) > limit else "")


def resolve_roles(shapes: Mapping[str, tuple[int, ...]], *, custom: Mapping[str, str] | None = None,
                  only: Sequence[str] | None = None) -> RoleLayout:
    """Find every role's matrices in ``{tensor name: shape}``; validate before anything is loaded.

    Raises :class:`FlowgeomError` when no scheme matches (listing the names
    found), when two tensors claim one (role, layer), when a role's matrices
    change shape between layers, when a role has fewer than two layers, or
    when layers are missing in the middle.
    """
    if custom:
        scheme, found = "custom", _match([RolePattern(r, rx) for r, rx in custom.items()], shapes)
    else:
        matches = {name: _match(pats, shapes) for name, pats in SCHEMES.items()}
        scheme = max(matches, key=lambda s: sum(len(v) for v in matches[s].values()))
        found = matches[scheme]
    if not found:
        raise FlowgeomError(
            f"no projection matrices recognised among {len(shapes)} tensors ({_listing(sorted(shapes))}); "
            f"known namings: {', '.join(SCHEMES)}; pass --role NAME=REGEX with a (\\d+) layer group for others")
    if only:
        missing = [r for r in only if r not in found]
        if missing:
            raise FlowgeomError(f"role(s) {', '.join(missing)} not found; roles present: {', '.join(found)}")
        found = {r: found[r] for r in only}
    order = list(custom or ROLES)
    roles = {r: _validate_role(r, found[r]) for r in sorted(found, key=lambda r: order.index(r) if r in order else 99)}
    return RoleLayout(scheme, roles)


def _validate_role(role: str, by_layer: dict[int, list[MatrixRef]]) -> list[MatrixRef]:
    for layer, refs in by_layer.items():
        if len(refs) > 1:
            raise FlowgeomError(f"role {role}, layer {layer}: several tensors match ({', '.join(r.tensor for r in refs)}); "
                                "pass --role with a pattern that picks one")
    refs = [by_layer[layer][0] for layer in sorted(by_layer)]
    if len(refs) < 2:
        raise FlowgeomError(f"role {role} has only {len(refs)} layer ({refs[0].tensor}); cross-layer continuity "
                            "needs at least two layers")
    layers = [r.layer for r in refs]
    gaps = sorted(set(range(layers[0], layers[-1] + 1)) - set(layers))
    if gaps:
        raise FlowgeomError(f"role {role} is missing layer(s) {gaps} between {layers[0]} and {layers[-1]}; "
                            "the checkpoint looks incomplete (a missing shard?)")
    shapes = {r.shape for r in refs}
    if len(shapes) > 1:
        detail = "; ".join(f"layer {r.layer}: {list(r.shape)}" for r in refs if r.shape != refs[0].shape)
        raise FlowgeomError(f"role {role} changes shape between layers (layer {refs[0].layer}: {list(refs[0].shape)}; "
                            f"{detail}); analyse such roles separately with --role patterns per shape")
    return refs
