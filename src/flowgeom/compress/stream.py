"""``compress run --stream``: compress a Llama larger than memory, one decoder block at a time.

Llama only: the blocks are built as flowgeom's own :class:`~flowgeom.nn.llama.DecoderLayer`.
:func:`~flowgeom.compress.run.run_compression` holds the whole model in float32
(and a second copy while it builds the module). Streaming holds one block:

1. the source is an HF folder of sharded safetensors (an index and its
   shards), read one tensor at a time by
   :class:`~flowgeom.io.sources.SafetensorsSource` (a ``pread`` of each
   tensor's validated span, so no mapped page stays resident);
2. the plan is made from shapes only (``svd`` and ``whiten`` with even ranks:
   a unit is one role of one layer, its rank fixed by the shape and the
   budget), before any weight is read;
3. the calibration ids are embedded, ``h_0 = E[ids]`` (S, T, d), and the
   embedding matrix is freed;
4. for block l: read its tensors, build one
   :class:`~flowgeom.nn.llama.DecoderLayer` on them (no copy), run ``h_l``
   through it :data:`BATCH` sequences at a time while hooks sum the four
   input Grams as :func:`~flowgeom.compress.calibrate.calibrate` sums them
   (equal bit for bit, tested), factorise the block's units with those Grams
   (:func:`~flowgeom.compress.plan._unit_factors`, balanced float32 factors),
   write each unit's factors and then the rest of the block (norms) to
   temporary files, and move on with ``h_{l+1}`` = the dense block's output
   (or, with ``sequential``, the output of the block rebuilt from its
   factors, as :func:`~flowgeom.compress.plan.compress_sequential` does);
5. ``flowgeom_factored.safetensors`` is assembled from the temporaries and the source's
   untouched tensors (embeddings, final norm, an untied head) one tensor at a
   time, and the temporaries are deleted; everything happens inside
   :func:`~flowgeom.compress.write.write_folder`'s temporary folder, so an
   error leaves nothing behind.

Peak memory ~ the embedding matrix (step 3 only), or one block with its
float64 Grams, plus the float64 work of whitening the widest projection
input (down_proj's: four (n, n) float64 matrices, 1 GB at n = 5,632), plus
two copies of the calibration states (S T d floats). Measured: a peak RSS
of 1.68 GB, 0.61x the float32 size of a 2.75 GB Llama, ~0.87 GB of it the
whitening of one down_proj (docs/compression.md). Not streamed:
``--allocate loss`` (its gradients flow through the whole model), methods
whose units span blocks (basis-sharing, share, continuity), block dropping
and ``mixed`` (scores over all blocks), ``--dense``, ``--refit``. The Gram
cache is not used: its key is a digest of every weight of the model.
Calibration and factorisation run on the CPU (no ``--device``).
"""

from __future__ import annotations

import math
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from flowgeom.compress import plan as C
from flowgeom.compress.arch import HF_NAMES, ROLE_GRAM
from flowgeom.compress.calibrate import GRAM_KEYS, calibration_ids, check_rank, gram_hooks
from flowgeom.compress.folder import FORMAT, JSON_NAME, VERSION, WEIGHTS_NAME, basis_name, coeff_name
from flowgeom.compress.folder import factored_config_json
from flowgeom.compress.run import STORAGE, CompressionConfig, Progress, renamed, role_table
from flowgeom.compress.source import check_vocab, model_tokenizer, source_path
from flowgeom.compress.write import check_out_folder, stream_safetensors, write_folder, write_model_files
from flowgeom.errors import FlowgeomError
from flowgeom.memory import trim_heap

STREAM_METHODS = ("svd", "whiten")  # every unit is one role of one layer: the block holds all it needs
BATCH = 4  # sequences per forward call: calibrate()'s default, so the Grams are summed in the same order
INPUTS = {key: path for key, (path, _) in GRAM_KEYS.items()}  # Gram key -> the Llama module whose input it is
_RESHARD = "model.save_pretrained(DIR, max_shard_size=\"500MB\")"


def __getattr__(name: str):
    raise renamed(__name__, name, {"stream_share": "stream_compression"})


# ---------------------------------------------------------------- when and what to stream

def float32_bytes(source: str) -> int | None:
    """Bytes the source's tensors take in float32 (what :func:`~flowgeom.compress.run.run_compression`
    holds), from its headers only; None when the source cannot be read (the compression itself then reports why)."""
    from flowgeom.io import local_path, open_source

    try:
        shapes = open_source(local_path(source)).shapes
    except (FlowgeomError, OSError):
        return None
    return 4 * sum(math.prod(s) for s in shapes.values())


def available_bytes() -> int | None:
    """``MemAvailable`` of /proc/meminfo in bytes (Linux), else None."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def stream_by_default(source: str, *, asked: bool, heal: bool = False) -> bool:
    """Whether ``compress run`` streams: when asked, or when the source's float32 size exceeds the available
    memory (one line on stderr says so). ``heal`` (``--heal``) trains the whole compressed model, refused."""
    stream = asked
    if not asked:
        need, free = float32_bytes(source), available_bytes()
        if need is not None and free is not None and need > free:
            print(f"flowgeom: {source} takes {need / 1e9:.1f} GB in float32, more than the {free / 1e9:.1f} GB "
                  "available: compressing it block by block (--stream)", file=sys.stderr)
            stream = True
    if stream and heal:
        raise FlowgeomError("--heal trains the whole compressed model in memory, which --stream avoids; compress "
                            "with --stream first, then run `flowgeom compress heal` on a machine that holds it")
    return stream


def check_streamable(config: CompressionConfig) -> None:
    """Refuse what cannot be computed one block at a time, with why and what to use instead."""
    if config.method not in STREAM_METHODS:
        raise FlowgeomError(f"--stream supports --method {' and '.join(STREAM_METHODS)} (one unit per layer); "
                            f"--method {config.method} " + ("drops blocks chosen by scores over the whole model"
                                                            if config.method in ("drop-angular", "drop-bi", "mixed")
                                                            else "shares bases across blocks")
                            + ": use --method whiten, or drop --stream on a machine that holds the model")
    if config.allocate == "loss":
        raise FlowgeomError("--stream cannot use --allocate loss: its gradients flow through the whole model at "
                            "once; use --allocate even, or drop --stream on a machine that holds the model")
    if config.dense or config.refit:
        raise FlowgeomError("--stream writes a factored folder; --dense and --refit are not streamed: drop them "
                            "(a factored folder loads densely with flowgeom.compress.folder.dense_state)")


def sharded_folder(source: str) -> Path:
    """The HF folder of sharded safetensors ``source`` names; anything else refused with the conversion."""
    if source.startswith("builtin:") or source.endswith(".gguf"):
        raise FlowgeomError(f"--stream reads an HF folder of sharded safetensors; {source} is a GGUF: convert it "
                            "with transformers, AutoModelForCausalLM.from_pretrained(DIR, gguf_file=NAME, "
                            "torch_dtype=torch.float32).save_pretrained(OUT, max_shard_size=\"500MB\"), or drop "
                            "--stream if it fits in memory")
    path = source_path(source)
    if not path.is_dir():
        raise FlowgeomError(f"--stream reads an HF folder (config.json + model.safetensors.index.json + shards); "
                            f"{source} is a file: save the model as one with {_RESHARD}")
    if any(path.glob("*.gguf")) and not (path / "config.json").is_file():
        return sharded_folder(str(next(path.glob("*.gguf"))))  # the GGUF refusal, with its conversion
    indexes = sorted(path.glob("*.safetensors.index.json"))
    if not indexes or not (path / "config.json").is_file():
        what = "no config.json" if not (path / "config.json").is_file() else "no model.safetensors.index.json"
        raise FlowgeomError(f"--stream reads sharded safetensors one tensor at a time; {source} has {what}: "
                            f"re-save it sharded with {_RESHARD}, or drop --stream if it fits in memory")
    _check_shards(indexes[0])
    return path


def _check_shards(index: Path) -> None:
    """Every shard the index names is there (the reader then checks each one's contents against the index)."""
    from flowgeom.io.checkpoints import read_index

    names = sorted(set(read_index(index).values()))
    missing = [n for n in names if not (index.parent / n).exists()]
    if missing:
        raise FlowgeomError(f"{index.parent}: {index.name} names {len(names)} shards but {len(missing)} are missing "
                            f"(first: {missing[0]}); download or copy every shard, then run again")

def _block_names(shapes: Mapping[str, Any], layer: int) -> list[str]:
    prefix = f"model.layers.{layer}."
    return sorted(k for k in shapes if k.startswith(prefix))


def _read_block(src, layer: int) -> dict[str, torch.Tensor]:
    """Block ``layer``'s tensors in float32 (integer codes refused, as the in-memory loader does)."""
    from flowgeom.nn.llama import float_weights

    return float_weights(src.label, {k: src.load(k) for k in _block_names(src.shapes, layer)})


def _decoder_layer(cfg, block: Mapping[str, torch.Tensor], layer: int):
    """A :class:`~flowgeom.nn.llama.DecoderLayer` whose parameters *are* ``block``'s tensors (no copy)."""
    from flowgeom.nn.llama import DecoderLayer

    prefix = f"model.layers.{layer}."
    with torch.device("meta"):
        module = DecoderLayer(cfg)
    module.load_state_dict({k[len(prefix):]: v for k, v in block.items()}, strict=True, assign=True)
    return module.eval()


def _run(layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, grams: dict | None) -> torch.Tensor:
    """``layer`` over ``h`` (S, T, d), :data:`BATCH` sequences a call (calibrate's batching); ``grams``
    accumulates the input Grams."""
    handles = [] if grams is None else gram_hooks(layer, INPUTS, grams)
    try:
        with torch.inference_mode():
            return torch.cat([layer(h[i:i + BATCH], cos, sin) for i in range(0, len(h), BATCH)])  # (S, T, d)
    finally:
        for handle in handles:
            handle.remove()


def _rel_error(weight: torch.Tensor, rebuilt: torch.Tensor) -> float:
    """``||W - W'||_F / ||W||_F`` in float64, as the report of the in-memory path measures it."""
    w = weight.double()
    return float(torch.linalg.matrix_norm(w - rebuilt.double()) / torch.linalg.matrix_norm(w))


def _factor_block(units, block: dict, grams: dict | None, save: Callable[[dict], None], *,
                  layer=None) -> tuple[dict[str, float], list[str]]:
    """Factorise one block's units; ``save`` gets each unit's stored tensors as soon as they exist.
    Returns the relative error per role and the notes.

    Consumes: each factored weight leaves ``block`` and each Gram leaves ``grams`` after its last use, and
    nothing of a unit is kept once saved, so the float64 work of the last unit (down_proj, the widest
    Gram: four (n, n) float64 matrices inside the whitening) runs beside as little as possible. ``layer``
    (the sequential variant): each factored projection is replaced by its reconstruction.
    """
    errors, notes = {}, []
    uses = Counter(ROLE_GRAM[u.role] for u in units)
    for unit in units:
        (l,), key = unit.layers, ROLE_GRAM[unit.role]
        g = None if grams is None else grams[key].unsqueeze(0)  # (1, n, n): one layer
        f = C._unit_factors(unit, block, g, refit=False)
        del g
        if (note := C._shift_note(unit, f)) is not None:
            notes.append(note)
        f = C._as_float(f)
        rebuilt = f.dense()[0]  # (m, n)
        errors[unit.role] = _rel_error(block.pop(C.weight_key(l, unit.role)), rebuilt)
        save({basis_name(unit.role, unit.layers): f.basis, coeff_name(l, unit.role): f.coeffs[0]})
        if layer is not None:
            layer.get_submodule(HF_NAMES[unit.role]).weight = torch.nn.Parameter(rebuilt, requires_grad=False)
        del f, rebuilt
        uses[key] -= 1
        if grams is not None and not uses[key]:
            del grams[key]
        trim_heap()
    return errors, notes


def _stored_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The factored folder's rule (:func:`~flowgeom.compress.folder.factored_tensors`): norms float32."""
    return torch.float32 if name.endswith("norm.weight") else dtype


# ---------------------------------------------------------------- the whole model, block by block

def _save(path: Path, tensors: Mapping[str, torch.Tensor]) -> Path:
    """A temporary safetensors file (one unit's factors, or the rest of a block) in the output's temporary folder."""
    from flowgeom.files import atomic_write

    return atomic_write(path, lambda fh: stream_safetensors(fh, dict(tensors)), root=path.parent)


def _stream_blocks(tmp: Path, src, cfg, plan_: C.Plan, ids: torch.Tensor | None, config: CompressionConfig,
                   progress: Progress | None) -> tuple[list[Path], dict, list[str], float]:
    """Write every block's stored tensors to temporary files in ``tmp`` (one per unit, one for the rest of the
    block); returns the files, the rel. errors by (layer, role), the notes and the seconds spent running
    blocks (the calibration)."""
    from flowgeom.nn.llama import float_weights, rope_tables

    h = cos = sin = None
    if ids is not None:
        embed = "model.embed_tokens.weight"
        h = F.embedding(ids, float_weights(src.label, {embed: src.load(embed)})[embed])  # (S, T, d)
        cos, sin = rope_tables(cfg, ids.shape[1], dtype=h.dtype)  # (T, hd) each
        trim_heap()
    by_layer: dict[int, list[C.Unit]] = {}
    for unit in plan_.units:
        by_layer.setdefault(unit.layers[0], []).append(unit)
    files, errors, notes, seconds = [], {}, [], 0.0
    L, dtype = cfg.num_hidden_layers, STORAGE[config.dtype]

    def save(tensors: dict[str, torch.Tensor]) -> None:
        stored = {k: v.to(_stored_dtype(k, dtype)).contiguous() for k, v in tensors.items()}
        files.append(_save(tmp / f".part-{len(files):06d}.safetensors", stored))

    for l in range(L):
        block, units = _read_block(src, l), by_layer.get(l, [])
        layer = grams = None
        if h is not None:
            t0, layer, grams = time.perf_counter(), _decoder_layer(cfg, block, l), {}
            out = _run(layer, h, cos, sin, grams)
            seconds += time.perf_counter() - t0
            if not config.sequential:  # the block's input and module are done with: free them before factorising
                h, layer = out, None
            del out
            trim_heap()  # the forward's freed activations
        block_errors, block_notes = _factor_block(units, block, grams, save, layer=layer)
        errors |= {(l, role): e for role, e in block_errors.items()}
        notes += block_notes
        save(block)  # what is left: the norms and any projection outside --roles
        if layer is not None:  # sequential: the compressed block's own output feeds the next block's Grams
            h = _run(layer, h, cos, sin, None)
        del block, layer, grams  # before the next block is read
        trim_heap()
        if progress:
            progress("stream", l + 1, L)
    return files, errors, notes, seconds


class _Pending:
    """A tensor read only when the writer asks for its bytes.

    :func:`~flowgeom.compress.write.stream_safetensors` lays out the header from each value's ``dtype``,
    ``shape``, ``numel()`` and ``element_size()``, then writes ``value.detach()`` one tensor at a time; this
    answers the first from the plan and loads on ``detach``, so one tensor is in memory at a time.
    """

    def __init__(self, shape, dtype: torch.dtype, load: Callable[[], torch.Tensor]):
        self.shape, self.dtype, self._load = tuple(shape), dtype, load

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def detach(self) -> torch.Tensor:
        t = self._load()
        if tuple(t.shape) != self.shape or t.dtype != self.dtype:  # a header promise the bytes must keep
            raise FlowgeomError(f"internal: a streamed tensor came back as {list(t.shape)} {t.dtype}, the header "
                                f"says {list(self.shape)} {self.dtype}")
        return t


def _final_tensors(src, cfg, files: list[Path], dtype: torch.dtype) -> dict[str, _Pending]:
    """Every tensor of the weights file, pending: the blocks' temporaries and the source's other tensors."""
    from flowgeom.io import open_source
    from flowgeom.nn.llama import float_weights

    def from_source(name: str):
        return lambda: float_weights(src.label, {name: src.load(name)})[name].to(_stored_dtype(name, dtype))

    out = {}
    blocks = {f"model.layers.{l}." for l in range(cfg.num_hidden_layers)}
    for name, shape in src.shapes.items():
        if name.startswith(tuple(blocks)) or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        out[name] = _Pending(shape, _stored_dtype(name, dtype), from_source(name))
    for path in files:  # opened again for each tensor: a model of 80 blocks leaves 640 files, too many to keep open
        for name, shape in open_source(path).shapes.items():
            out[name] = _Pending(shape, _stored_dtype(name, dtype), lambda path=path, name=name:
                                 open_source(path).load(name))
    return out


# ---------------------------------------------------------------- the report

def _report(source: str, out: Path, config: CompressionConfig, cfg, shapes, plan_: C.Plan, errors, facts) -> dict:
    total = sum(math.prod(s) for k, s in shapes.items() if k != "lm_head.weight" or not cfg.tie_word_embeddings)
    saved = plan_.dense_params - plan_.stored_params
    return {
        "source": str(source), "out": str(out), "method": config.method, "budget": config.budget,
        "rank": config.rank, "group": config.group, "space": config.space, "sequential": config.sequential,
        "refit": False, "format": "factored", "dtype": config.dtype, "stream": True,
        "scope_params": plan_.dense_params, "scope_saved_params": saved,
        "scope_saved_fraction": saved / plan_.dense_params, "roles": role_table(plan_, errors), "model_params": total,
        "saved_params": saved, "saved_fraction": saved / total, "params_after": total - saved,
        **{k: v for k, v in facts.items() if k != "notes"}, "notes": list(facts["notes"]),
    }


# ---------------------------------------------------------------- the library call

def stream_compression(source: str, out: Path, config: CompressionConfig, *, force: bool = False,
                       progress: Progress | None = None) -> dict[str, Any]:
    """Compress ``source`` (an HF folder of sharded safetensors) into the factored folder ``out`` one block
    at a time (module docstring); returns the report written beside it as ``flowgeom_share.json``."""
    from flowgeom.files import read_json_object
    from flowgeom.io import open_source
    from flowgeom.nn.llama import LlamaConfig, check_state

    t0 = time.perf_counter()
    check_streamable(config)
    path = sharded_folder(source)
    check_out_folder(path, out, force=force)
    try:
        cfg = LlamaConfig.from_hf(read_json_object(path / "config.json", fix="re-export the model's config.json"))
    except FlowgeomError as exc:
        raise FlowgeomError(f"--stream compresses Llama folders: {path}: {exc}") from None
    src = open_source(path)  # index and shards checked against each other: a missing shard is refused here
    meta = {k: torch.empty(s, device="meta") for k, s in src.shapes.items()}  # shapes, nothing allocated
    check_state(cfg, meta)
    L = cfg.num_hidden_layers
    plan_ = C.plan(config.method, meta, n_layers=L, ratio=config.budget if config.budget is not None else 0.5,
                   roles=config.roles)  # svd and whiten read only shapes
    if config.rank is not None:
        plan_ = C.with_rank(plan_, config.rank)
    tokenizer = model_tokenizer(path)
    check_vocab(tokenizer, cfg, source)
    facts: dict[str, Any] = {"allocate": "even", "notes": []}
    if config.allocate is None and config.calibrated:
        facts["notes"].append("ranks even: --stream cannot allocate by the calibration loss (its gradients flow "
                              "through the whole model)")
    ids = None
    if config.calibrated:
        ids = calibration_ids(path, config.calib, config.calib_tokens, config.seq_len, tokenizer)
        check_rank({"attn": cfg.hidden_size, "o": cfg.num_attention_heads * cfg.head_dim, "mlp": cfg.hidden_size,
                    "down": cfg.intermediate_size}, config.calib_tokens)
    report: dict[str, Any] = {}

    def fill(tmp: Path) -> None:
        files, errors, notes, seconds = _stream_blocks(tmp, src, cfg, plan_, ids, config, progress)
        if ids is not None:
            facts.update(calib=config.calib, calib_tokens=int(ids.numel()), calib_cached=False, calib_seconds=seconds)
        facts["notes"] += notes
        report.update(_report(source, out, config, cfg, src.shapes, plan_, errors, facts))
        report["tokenizer"] = None if tokenizer is None else "tokenizer.json"
        if tokenizer is None:
            report["notes"].append("the source has no tokenizer.json, so none was written; evaluate the result "
                                   "with --compare next to a reference model that has one")
        meta_json = {"format": FORMAT, "version": VERSION, "units": [
            {"role": u.role, "space": u.space, "layers": list(u.layers), "rank": u.rank, "shape": list(u.shape),
             "basis": basis_name(u.role, u.layers), "coeffs": [coeff_name(l, u.role) for l in u.layers]}
            for u in plan_.units]}
        tensors = _final_tensors(src, cfg, files, STORAGE[config.dtype])
        if progress:
            progress("assemble", 0, 1)
        write_model_files(tmp, tensors, factored_config_json(cfg.to_hf()), tokenizer=tokenizer, report=report,
                          extra={JSON_NAME: meta_json}, weights=WEIGHTS_NAME)
        for f in files:
            f.unlink()
        if progress:
            progress("assemble", 1, 1)

    write_folder(out, fill, force=force)
    report["seconds"] = time.perf_counter() - t0
    return report
