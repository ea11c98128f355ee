"""Map checkpoint tensor names to projection roles, splitting fused tensors; list what is left.

Each naming scheme is an ordered list of :class:`RolePattern` (a regex whose
group ``layer`` is the block index), matched against tensor names with PEFT's
wrapping removed (``base_model.model.`` prefix, ``.base_layer`` segment: the
base weight of an adapted projection is that projection). The first pattern
that matches claims the tensor. Every matrix is returned in the ``(out, in)``
layout of ``nn.Linear``; fused tensors are split by row ranges
(:mod:`flowgeom.continuity.layouts`), 3-D expert stacks by expert index, one
tensor loaded at a time.

* ``llama`` (Llama, Mistral, Qwen2/3, Gemma, flowgeom.nn zoo): ``….<L>.….q_proj.weight``
  … ``down_proj.weight``, the layer being the first all-digit segment; Phi-3
  ``self_attn.qkv_proj`` (rows q | k | v, GQA sizes from the head counts) and
  ``mlp.gate_up_proj`` (gate | up); MoE: router ``mlp.gate`` /
  ``block_sparse_moe.gate`` -> ``router``; Mixtral on disk
  ``block_sparse_moe.experts.N.w1/w3/w2`` -> ``expertN.gate/up/down``;
  Qwen2-MoE / OLMoE ``mlp.experts.N.gate_proj…``; transformers-5 fused
  ``mlp.experts.gate_up_proj (E, 2m, d)`` / ``down_proj (E, d, m)`` (one
  expert sliced at a time); Qwen2-MoE ``mlp.shared_expert.*`` ->
  ``shared.gate/up/down`` and ``mlp.shared_expert_gate`` (1 x d) -> ``shared.router``.
* ``gguf`` (llama.cpp): ``blk.<L>.attn_q.weight`` … ``ffn_down.weight``. GGUF
  stores Q/K rows permuted for its RoPE layout; the permutation is the same in
  every layer, so cross-layer |cos| is unchanged.
* ``bert``: ``layer.<L>.attention.self.query/key/value``, ``attention.output.dense``
  (o), ``intermediate.dense`` (up), ``output.dense`` (down).
* ``gpt2``: ``h.<L>.attn.c_attn`` is Conv1D ``(in, 3 out)``: transposed, then
  rows split into q, k, v thirds; ``attn.c_proj`` (o), ``mlp.c_fc`` (up),
  ``mlp.c_proj`` (down), all transposed.
* ``gpt_neox``: ``layers.<L>.attention.query_key_value`` interleaved per head
  (rows ``(H, 3, hd)``), ``attention.dense`` (o), ``mlp.dense_h_to_4h`` (up),
  ``mlp.dense_4h_to_h`` (down).
* ``falcon``: ``h.<L>.self_attention.query_key_value`` in rows
  ``(KV, H/KV + 2, hd)`` (multi-query: KV = 1; new decoder architecture: KV =
  ``num_kv_heads``), ``self_attention.dense`` (o), ``mlp.dense_h_to_4h`` (up),
  ``mlp.dense_4h_to_h`` (down).

PEFT LoRA tensors ``….lora_A[.<adapter>].weight`` / ``lora_B`` are listed per
adapted module; with ``merge_lora`` the role's matrix is ``W + s·B A``
(:func:`flowgeom.continuity.layouts.lora_scale`). Nothing is dropped in
silence: :class:`RoleLayout` lists every tensor no role uses with the reason,
and warns when a family of roles is incomplete (attention with no q, an
expert without its down projection, …).

Unknown naming: pass ``custom={"name": regex}`` (CLI ``--role NAME=REGEX``),
the regex's first group (or group ``layer``) being the layer index.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch

from flowgeom.continuity.layouts import LayoutError, NamingHints, Rows, half_rows, lora_scale, qkv_rows, strip_peft
from flowgeom.errors import FlowgeomError
from flowgeom.hf.families import FAMILIES, Family, FusedLayout

ROLES = ("q", "k", "v", "o", "gate", "up", "down")
ATTENTION = ("q", "k", "v", "o")
SHARED = ("shared.gate", "shared.up", "shared.down", "shared.router")
_EXPERT_PARTS = ("gate", "up", "down")
_LAYER = r"^(?:.*?\.)?(?P<layer>\d+)\.(?:.*\.)?"
_MAX_DIGITS = 12  # layer / expert indices beyond 10^12 are not real models
_LORA = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.(?P<adapter>[^.]+))?\.weight$")
_EMBED = re.compile(r"(?:^|\.)(?:embed_tokens|embed_in|embed_out|wte|wpe|word_embeddings|position_embeddings|"
                    r"token_type_embeddings|lm_head|token_embd|output)\.weight$")


@dataclass(frozen=True)
class RolePattern:
    """``regex`` matches a (PEFT-stripped) tensor name for role ``role``.

    ``transpose`` for (in, out) storage; ``split=(i, parts)`` takes row block i
    of ``parts`` equal blocks; ``fused=(layout, part)`` the rows of ``part`` in
    a fused layout (:mod:`~flowgeom.continuity.layouts`: ``blocked``,
    ``grouped``, ``interleaved``, ``thirds`` with part q/k/v; ``halves`` with
    part 0/1); ``experts`` marks a 3-D ``(E, out, in)`` stack whose expert e
    gives role ``role`` with ``{expert}`` replaced by e (a regex group
    ``expert`` does the same for per-expert tensors).
    """

    role: str
    regex: str
    transpose: bool = False
    split: tuple[int, int] | None = None
    fused: tuple[str, str | int] | None = None
    experts: bool = False


_DENSE_MLP = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


def _fused_kind(layout: FusedLayout) -> str:
    """The row split of :mod:`~flowgeom.continuity.layouts` that reads ``layout`` from names and shapes alone."""
    if layout.arrangement == "per_head":
        return "interleaved"
    if layout.arrangement == "falcon":
        return "grouped"
    if "half" in layout.units:
        return "halves"
    return "thirds" if layout.axis == 1 else "blocked"  # GPT-2's Conv1D columns are equal q|k|v thirds


def family_patterns(fam: Family) -> list[RolePattern]:
    """The naming scheme of one family, derived from its table entry; the most specific names first.

    A family without a layer container (``fam.layers == ""``: Llama-style
    names) matches the weight's own path after any prefix holding an all-digit
    layer segment, so the flowgeom zoo and re-wrapped models match too; one
    with a container matches ``<container>.<L>.<block>.<path>`` exactly (GPT-2's
    ``attn.c_proj`` and ``mlp.c_proj`` differ only by their block).
    """
    layer = _LAYER if not fam.layers else rf"(?:^|\.){re.escape(fam.layers)}\.(?P<layer>\d+)\."
    transpose = fam.attention == "conv1d"

    def rx(block: str, path: str, *, stack: bool = False) -> str:
        full = f"{block}.{path}" if fam.layers and block else path
        parts = [re.escape(bit) for bit in full.split("{e}")]
        return layer + r"(?P<expert>\d+)".join(parts) + (r"(?:\.weight)?$" if stack else r"\.weight$")

    def role_pats(role: str, block: str, path: str, *, stack: bool = False) -> list[RolePattern]:
        fused = fam.fused_layout(f"{block}.{path}" if block else path)
        r = rx(block, path, stack=stack)
        if fused is None:
            return [RolePattern(role, r, transpose, experts=stack)]
        kind, expert = _fused_kind(fused), "expert{expert}." if stack else ""
        return [RolePattern(f"{expert}{part}", r, transpose, fused=(kind, i if kind == "halves" else part),
                            experts=stack) for i, part in enumerate(fused.roles)]

    pats = [RolePattern(f"expert{{expert}}.{part}", rx(fam.mlp_path, path))  # per-expert tensors on disk
            for part, path in fam.expert_files.items()]
    pats += [RolePattern(f"shared.{part}", rx(fam.mlp_path, path)) for part, path in fam.shared_weights.items()]
    mlp = dict(fam.mlp_weights)
    if fam.mlp == "moe":
        pats += role_pats("expert{expert}.gate_up", fam.mlp_path, mlp.pop("gate_up"), stack=True)
        pats += role_pats("expert{expert}.down", fam.mlp_path, mlp.pop("down"), stack=True)
    for role, path in fam.weights.items():
        pats += role_pats(role, fam.attention_path, path)
    for role, path in mlp.items():
        pats += role_pats(role, fam.mlp_path, path)
    if fam.mlp == "moe":  # dense layers of a MoE model (Qwen2-MoE's mlp_only_layers): after the experts' names
        pats += [RolePattern(role, rx(fam.mlp_path, path)) for role, path in _DENSE_MLP.items()]
    return pats


def _schemes() -> dict[str, list[RolePattern]]:
    """One scheme per distinct family naming (named by its first family), then llama.cpp's GGUF names."""
    schemes: dict[str, list[RolePattern]] = {}
    for name, fam in FAMILIES.items():
        pats = family_patterns(fam)
        if pats not in schemes.values():
            schemes[name] = pats
    # GGUF is a file format, not a transformers family: llama.cpp's own names
    schemes["gguf"] = [RolePattern(r, rf"^blk\.(?P<layer>\d+)\.{n}\.weight$") for r, n in
                       (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("o", "attn_output"),
                        ("gate", "ffn_gate"), ("up", "ffn_up"), ("down", "ffn_down"))]
    return schemes


SCHEMES: dict[str, list[RolePattern]] = _schemes()


@dataclass(frozen=True)
class LoraDelta:
    """The LoRA update ``scale · B A`` added to a base weight (``a``, ``b``: tensor names)."""

    a: str  # (r, in)
    b: str  # (out, r)
    scale: float


@dataclass(frozen=True)
class MatrixRef:
    """One projection matrix: which tensor, how to view it as (out, in), its final shape.

    ``rows``: row ranges of the (out, in) view, concatenated (a fused tensor's
    share); ``expert``: index into the leading axis of a 3-D expert stack;
    ``lora``: a LoRA update merged into the stored weight before the view.
    """

    role: str
    layer: int
    tensor: str
    shape: tuple[int, int]
    transpose: bool = False
    rows: Rows | None = None
    expert: int | None = None
    lora: LoraDelta | None = None

    def extract(self, t: torch.Tensor) -> torch.Tensor:
        """The (out, in) matrix from the stored tensor ``t`` (a whole 3-D stack or its expert slice)."""
        if self.expert is not None and t.ndim == 3:
            t = t[self.expert]  # (out, in) or (in, out) of one expert
        if self.transpose:
            t = t.mT
        if self.rows is not None:
            parts = [t[a:b] for a, b in self.rows]
            t = parts[0] if len(parts) == 1 else torch.cat(parts)  # (rows, in)
        return t

    def load(self, source) -> torch.Tensor:
        """Read this matrix from a :class:`~flowgeom.io.sources.TensorSource`: one tensor (or one expert)."""
        t = source.load(self.tensor) if self.expert is None else source.load_part(self.tensor, self.expert)
        if self.lora is not None:
            a, b = source.load(self.lora.a), source.load(self.lora.b)  # (r, in), (out, r)
            delta = self.lora.scale * (b.double() @ a.double())  # (out, in)
            if not bool(torch.isfinite(delta).all()):
                raise FlowgeomError(f"--merge-lora: s·B·A of {self.tensor} is not finite in float64 (LoRA scale "
                                    f"s = {self.lora.scale:g}, or inf/NaN in {self.lora.a} or {self.lora.b}); check "
                                    "lora_alpha in adapter_config.json and the adapter's weights")
            t = t.double() + (delta.mT if self.transpose else delta)  # stored layout
        return self.extract(t)


@dataclass(frozen=True)
class RoleLayout:
    """The matrices of every role, sorted by layer, and everything else the checkpoint holds.

    ``scheme`` names the naming map used; ``unmatched`` lists ``{"tensor",
    "shape", "reason"}`` for every tensor no analysed role uses; ``lora`` one
    entry per LoRA (module, adapter) pair; ``warnings`` incomplete role
    families and refused splits, as sentences.
    """

    scheme: str
    roles: dict[str, list[MatrixRef]]
    unmatched: list[dict] = field(default_factory=list)
    lora: list[dict] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def limited(self, max_layers: int | None, shapes: Mapping[str, tuple[int, ...]]) -> RoleLayout:
        """A new layout keeping each role's first ``max_layers`` layers, the others listed as unmatched (once each)."""
        if not max_layers or all(len(refs) <= max_layers for refs in self.roles.values()):
            return self
        unmatched, listed = list(self.unmatched), {u["tensor"] for u in self.unmatched}
        for refs in self.roles.values():
            for ref in refs[max_layers:]:
                if ref.tensor not in listed:
                    listed.add(ref.tensor)
                    unmatched.append({"tensor": ref.tensor, "shape": list(shapes[ref.tensor]),
                                      "reason": f"beyond --max-layers {max_layers}"})
        roles = {role: refs[:max_layers] for role, refs in self.roles.items()}
        return replace(self, roles=roles, unmatched=unmatched)


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


Found = dict[str, dict[int, list[MatrixRef]]]


def _refs(pat: RolePattern, hit: re.Match, name: str, shape: tuple[int, ...], hints: NamingHints) -> list[MatrixRef]:
    """The matrices ``pat`` takes from tensor ``name`` (several for an expert stack); LayoutError if unsplittable."""
    group = hit.group("layer") if "layer" in hit.re.groupindex else hit.group(1)
    if group is None or not (group.isascii() and group.isdigit()):
        raise FlowgeomError(f"role {pat.role}: the layer group of {pat.regex!r} matched {group!r} in {name}, "
                            "not a layer number; capture only the digits")
    tag = hit.group("expert") if "expert" in hit.re.groupindex else "0"
    if len(group) > _MAX_DIGITS or len(tag) > _MAX_DIGITS:  # int() of thousands of digits: forged names
        raise FlowgeomError(f"tensor {name[:80]}… has a layer or expert index of {max(len(group), len(tag))} "
                            "digits; the checkpoint's names are forged or corrupt")
    want = 3 if pat.experts else 2
    if len(shape) != want:
        kind = "a stack of expert matrices (E, out, in)" if pat.experts else "a matrix"
        raise FlowgeomError(f"tensor {name} (role {pat.role}) has shape {list(shape)}, not {kind}; "
                            "fix the --role pattern so it matches only 2-D weights")
    stored = shape[-2:]
    out, inp = (stored[1], stored[0]) if pat.transpose else stored
    rows = None
    if pat.split is not None:
        i, parts = pat.split
        if out % parts:
            raise FlowgeomError(f"fused tensor {name} has {out} output rows, not divisible into {parts} parts")
        rows = ((i * (out // parts), (i + 1) * (out // parts)),)
    elif pat.fused is not None:
        layout, part = pat.fused
        rows = half_rows(int(part), out) if layout == "halves" else qkv_rows(layout, str(part), out, hints)
    m = out if rows is None else sum(b - a for a, b in rows)
    tagged = "expert" in hit.re.groupindex
    refs = []
    for e in range(shape[0]) if pat.experts else (None,):
        idx = e if pat.experts else (int(hit.group("expert")) if tagged else None)
        role = pat.role.replace("{expert}", str(idx)) if idx is not None else pat.role
        refs.append(MatrixRef(role, int(group), name, (m, inp), pat.transpose, rows, e))
    return refs


def _match(patterns: Sequence[RolePattern], shapes: Mapping[str, tuple[int, ...]], hints: NamingHints, *,
           first_only: bool = True) -> tuple[Found, dict[str, str]]:
    """``(role -> layer -> refs, {refused tensor: reason})``; the first matching regex claims a tensor."""
    groups: dict[str, list[RolePattern]] = {}
    for p in patterns:
        groups.setdefault(p.regex, []).append(p)
    compiled = [(re.compile(rx), pats) for rx, pats in groups.items()]
    found: Found = {}
    refused: dict[str, str] = {}
    for name, shape in shapes.items():
        key = strip_peft(name)
        for rx, pats in compiled:
            hit = rx.search(key)
            if not hit:
                continue
            try:
                refs = [ref for p in pats for ref in _refs(p, hit, name, shape, hints)]
            except LayoutError as exc:
                refused[name] = str(exc)
            else:
                for ref in refs:
                    found.setdefault(ref.role, {}).setdefault(ref.layer, []).append(ref)
            if first_only:
                break
    return found, refused


def _claimed(result: tuple[Found, dict[str, str]]) -> set[str]:
    found, refused = result
    return {r.tensor for by_layer in found.values() for refs in by_layer.values() for r in refs} | set(refused)


def _slots(result: tuple[Found, dict[str, str]]) -> int:
    return sum(len(by_layer) for by_layer in result[0].values())


def _listing(names: Sequence[str], limit: int = 25) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", … ({len(names) - limit} more)" if len(names) > limit else "")


def _order(role: str, first: Sequence[str]) -> tuple:
    if role in first:
        return (0, first.index(role), 0, "")
    if role == "router":
        return (1, 0, 0, "")
    hit = re.fullmatch(r"expert(\d+)\.(gate|up|down)", role)
    if hit:
        return (2, int(hit[1]), _EXPERT_PARTS.index(hit[2]), "")
    if role in SHARED:
        return (3, SHARED.index(role), 0, "")
    return (4, 0, 0, role)


def _pair_lora(shapes: Mapping[str, tuple[int, ...]], names: Sequence[str], found: Found,
               hints: NamingHints) -> tuple[list[dict], Found]:
    """One entry per LoRA (module, adapter), and ``found`` with the chosen adapter merged (``hints.merge_lora``;
    a new mapping: ``found`` itself is left as it was)."""
    pairs: dict[tuple[str, str], dict[str, str]] = {}
    for name in names:
        hit = _LORA.match(strip_peft(name))
        pairs.setdefault((hit["module"], hit["adapter"] or "default"), {})[hit["ab"]] = name
    adapters = sorted({a for _, a in pairs})
    chosen = None
    if hints.merge_lora:
        if not pairs:
            raise FlowgeomError("--merge-lora: no LoRA tensors (….lora_A/lora_B….weight) in this checkpoint; point at "
                                "a folder holding both the base weights and adapter_model.safetensors (with its "
                                "adapter_config.json)")
        chosen = hints.lora_adapter or (adapters[0] if len(adapters) == 1 else None)
        if chosen not in adapters:
            raise FlowgeomError(f"--merge-lora: adapter {chosen!r} is not among the adapters found "
                                f"({', '.join(adapters)}); pass --lora-adapter NAME")
    bases: dict[str, list[tuple[str, int, int]]] = {}
    for role, by_layer in found.items():
        for layer, refs in by_layer.items():
            for i, ref in enumerate(refs):
                bases.setdefault(strip_peft(ref.tensor), []).append((role, layer, i))
    entries, merged = [], {}
    for (module, adapter), ab in sorted(pairs.items()):
        targets = bases.get(module + ".weight", [])
        entry = {"module": module, "adapter": adapter, "A": ab.get("A"), "B": ab.get("B"),
                 "rank": shapes[ab["A"]][0] if "A" in ab and shapes[ab["A"]] else None,
                 "roles": [f"{role}@{layer}" for role, layer, _ in targets], "merged": False}
        if "A" not in ab or "B" not in ab:
            entry["note"] = "incomplete pair: lora_A or lora_B missing"
            if adapter == chosen:
                raise FlowgeomError(f"--merge-lora: module {module} has only lora_{'A' if 'A' in ab else 'B'} for "
                                    f"adapter {adapter}; the adapter file is incomplete")
        elif not targets:
            entry["note"] = "its base weight is not among the analysed roles"
        elif adapter != chosen:
            entry["note"] = "not merged: pass --merge-lora to analyse W + s·B·A" if chosen is None else \
                f"not merged: adapter {chosen} was chosen"
        else:
            first = found[targets[0][0]][targets[0][1]][targets[0][2]]
            stored = shapes[first.tensor]
            if first.expert is not None:
                entry["note"] = "LoRA on a fused expert stack is not merged"
                entries.append(entry)
                continue
            out, inp = (stored[1], stored[0]) if first.transpose else stored
            if len(shapes[ab["A"]]) != 2 or len(shapes[ab["B"]]) != 2:
                raise FlowgeomError(f"LoRA {module}: A {list(shapes[ab['A']])} and B {list(shapes[ab['B']])} must both "
                                    f"be matrices, A (r, {inp}) and B ({out}, r); the adapter file is damaged: "
                                    "use the adapter_model.safetensors PEFT saved")
            (r, a_in), (b_out, r2) = shapes[ab["A"]], shapes[ab["B"]]
            if a_in != inp or b_out != out or r != r2:
                raise FlowgeomError(f"LoRA {module}: A {list(shapes[ab['A']])} and B {list(shapes[ab['B']])} do not "
                                    f"fit the base weight (out {out}, in {inp}): A must be (r, {inp}), B ({out}, r); "
                                    "the adapter belongs to another model")
            scale = lora_scale(module, adapter, r, hints)
            for role, layer, i in targets:
                merged[role, layer, i] = LoraDelta(ab["A"], ab["B"], scale)
            entry.update(merged=True, scale=scale)
        entries.append(entry)
    return entries, {role: {layer: [replace(ref, lora=merged[role, layer, i]) if (role, layer, i) in merged else ref
                                    for i, ref in enumerate(refs)] for layer, refs in by_layer.items()}
                     for role, by_layer in found.items()}


def _unmatched_reason(name: str, shape: tuple[int, ...], other: str | None, scheme: str) -> str:
    if len(shape) <= 1:
        return "1-D (norm/bias)"
    if _EMBED.search(strip_peft(name)):
        return "embedding / LM head"
    if "lora_" in name:
        return "LoRA tensor of a kind that is not merged (embedding, DoRA magnitude, …)"
    if other:
        return f"matches the {other} naming, not the {scheme} naming of this checkpoint"
    return "no scheme pattern (analyse it with --role NAME=REGEX)"


def _family_warnings(roles: set[str]) -> list[str]:
    """Sentences for incomplete role families: attention without q, an MLP without down, an expert without up, …"""
    out = []
    families = [("attention", ATTENTION, ATTENTION), ("MLP", ("gate", "up", "down"), ("up", "down")),
                ("shared expert", SHARED[:3], SHARED[:3])]
    experts = sorted({int(m[1]) for r in roles if (m := re.fullmatch(r"expert(\d+)\.\w+", r))})
    families += [(f"expert {e}", tuple(f"expert{e}.{p}" for p in _EXPERT_PARTS),
                  tuple(f"expert{e}.{p}" for p in _EXPERT_PARTS)) for e in experts]
    for family, members, needed in families:
        present = [r for r in members if r in roles]
        missing = [r for r in needed if r not in roles]
        if present and missing:
            out.append(f"{family} roles {', '.join(missing)} not found (found {', '.join(present)}); "
                       "the other roles are analysed")
    missing_count = experts[-1] + 1 - len(experts) if experts else 0
    if missing_count > 64:  # never materialise a range up to an absurd expert number
        out.append(f"expert numbers run to {experts[-1]} but only {len(experts)} experts were found; "
                   "the experts found are analysed")
        return out
    gaps = [x for a, b in zip([-1] + experts, experts) for x in range(a + 1, b)]
    if gaps:
        out.append(f"experts {gaps} not found among experts 0..{experts[-1]}; the others are analysed")
    return out


def resolve_roles(shapes: Mapping[str, tuple[int, ...]], *, custom: Mapping[str, str] | None = None,
                  only: Sequence[str] | None = None, hints: NamingHints | None = None) -> RoleLayout:
    """Find every role's matrices in ``{tensor name: shape}``; validate before anything is loaded.

    Raises :class:`FlowgeomError` when no scheme matches (listing the names
    found), when two tensors claim one (role, layer), when a role's matrices
    change shape between layers, when a role has fewer than two layers, or
    when layers are missing in the middle. A fused tensor whose split is
    ambiguous (no head counts) is not guessed: it is listed as unmatched with
    the reason and a warning.
    """
    hints = hints or NamingHints()
    lora_names = [n for n in shapes if _LORA.match(strip_peft(n))]
    plain = {n: s for n, s in shapes.items() if not _LORA.match(strip_peft(n))}
    others: dict[str, set[str]] = {}
    if custom:
        scheme = "custom"
        found, refused = _match([RolePattern(r, rx) for r, rx in custom.items()], plain, hints, first_only=False)
    else:
        matches = {name: _match(pats, plain, hints) for name, pats in SCHEMES.items()}
        # most tensors claimed; on a tie, the most (role, layer) slots: a scheme that puts two tensors in
        # one slot (experts read as plain gate/up/down) is the less specific reading
        scheme = max(matches, key=lambda s: (len(_claimed(matches[s])), _slots(matches[s])))
        found, refused = matches[scheme]
        others = {s: _claimed(m) for s, m in matches.items() if s != scheme}
    if not found and lora_names and not plain:
        raise FlowgeomError(
            f"these {len(lora_names)} tensors are only PEFT LoRA factors (lora_A/lora_B, e.g. {lora_names[0]}), "
            "no base weights: analyse the base model, or put adapter_model.safetensors and adapter_config.json "
            "in the base model's folder and pass --merge-lora to analyse W + s·B·A")
    if not found:
        why = "; ".join(f"{n}: {r}" for n, r in list(refused.items())[:3])
        raise FlowgeomError(
            f"no projection matrices recognised among {len(shapes)} tensors ({_listing(sorted(shapes))})"
            + (f"; refused: {why}" if why else "")
            + f"; known namings: {', '.join(SCHEMES)}; pass --role NAME=REGEX with a (\\d+) layer group for others")
    warnings = _family_warnings(set(found))
    by_reason: dict[str, list[str]] = {}
    for name, reason in refused.items():
        by_reason.setdefault(reason, []).append(name)
    warnings += [f"{len(names)} fused tensor(s) not split ({_listing(sorted(names), 3)}): {reason}"
                 for reason, names in by_reason.items()]
    lora, found = _pair_lora(shapes, lora_names, found, hints)
    excluded: dict[str, str] = {}
    if only:
        missing = [r for r in only if r not in found]
        if missing:
            why = f" (refused: {next(iter(by_reason))})" if by_reason else ""
            raise FlowgeomError(f"role(s) {', '.join(missing)} not found; roles present: {', '.join(found)}{why}")
        for role in set(found) - set(only):
            for refs in found[role].values():
                for ref in refs:
                    excluded.setdefault(ref.tensor, f"role {role} not selected (--roles)")
        found = {r: found[r] for r in only}
    first = list(custom or ROLES)
    roles = {r: _validate_role(r, found[r]) for r in sorted(found, key=lambda r: _order(r, first))}
    used = {ref.tensor for refs in roles.values() for ref in refs}
    unmatched = []
    for name, shape in shapes.items():
        if name in used or name in lora_names:
            continue
        other = next((s for s, claimed in others.items() if name in claimed), None)
        reason = refused.get(name) or excluded.get(name) or _unmatched_reason(name, shape, other, scheme)
        unmatched.append({"tensor": name, "shape": list(shape), "reason": reason})
    return RoleLayout(scheme, roles, unmatched, lora, warnings)


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
    missing = layers[-1] - layers[0] + 1 - len(layers)  # indices absent from the span (never materialised)
    if missing > len(layers):  # e.g. layers 0 and 10**12: a forged or mis-captured index, not a lost shard
        raise FlowgeomError(f"role {role}: {len(layers)} layers found but their indices run from {layers[0]} to "
                            f"{layers[-1]} ({refs[-1].tensor}); layer indices must number the layers found "
                            "consecutively: fix the tensor names, or the --role pattern's layer group")
    gaps = [x for a, b in zip(layers, layers[1:]) for x in range(a + 1, b)]  # at most len(layers) entries
    if gaps:
        raise FlowgeomError(f"role {role} is missing layer(s) {gaps} between {layers[0]} and {layers[-1]}; "
                            "the checkpoint looks incomplete (a missing shard?)")
    shapes = {r.shape for r in refs}
    if len(shapes) > 1:
        detail = "; ".join(f"layer {r.layer}: {list(r.shape)}" for r in refs if r.shape != refs[0].shape)
        raise FlowgeomError(f"role {role} changes shape between layers (layer {refs[0].layer}: {list(refs[0].shape)}; "
                            f"{detail}); analyse such roles separately with --role patterns per shape")
    return refs
