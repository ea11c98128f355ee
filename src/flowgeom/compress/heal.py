"""Healing: distil the dense model's logits into a compressed one.

A compressed folder (factored, or a Llama with dropped blocks) is the
*student*; the dense model it came from (``flowgeom_share.json``'s ``source``,
or ``teacher``) is the *teacher*. On healing text (by default the train
splits of the KJV and of the Python reference's prose, chunk for chunk; never
a held-out split it is judged on, nor the out-of-domain text) each step minimises the
per-token distillation loss

    KL(p_T || p_S) = sum_v p_T(v) (log p_T(v) - log p_S(v)),   averaged over the batch's tokens,

over the student's trainable tensors: the bases and coefficients of a factored
folder (they are stored balanced, :func:`flowgeom.compress.factorize.balance`,
so one optimiser step moves both by comparable relative amounts), or every
projection of a dropped model's remaining blocks; ``norms`` adds the RMSNorm
gains. Logit distillation instead of the LM loss follows Minitron (Muralidharan
et al. 2024) and LiLlama (2024): the teacher's full distribution carries far
more signal per token than the one observed next token.

Optimisers: ``adamw`` (betas 0.9/0.95, linear warm-up over ``warmup`` of the
steps, then a cosine decay to ``min_lr`` x lr), or the project's ``langevin``
(:class:`flowgeom.langevin.Langevin` with seed 004's log regulariser on every
factor: ``C B`` has LoRA's scale symmetry ``C D^{-1}, D B``, the orbit along
which the regulariser is what makes the loss confining), with the same schedule.

Cost and safety:

* memory: the student's blocks are recomputed in the backward pass
  (``torch.utils.checkpoint`` per block); the teacher runs without autograd; both
  heads and the KL run 256 token rows at a time, without autograd: the frozen
  head's gradient is ``p_S - p_T`` in closed form (:func:`distillation_step_loss`),
  so no (tokens, vocab) tensor is ever whole and no head runs twice;
  nothing is stored for the corpus;
* every ``checkpoint_every`` steps the trainable tensors, the optimiser state and
  the history go to ``<work>/checkpoint.safetensors`` (flowgeom's pickle-free
  checkpoint format, atomic); the batch of step k is drawn from a generator
  seeded by (seed, k), so ``resume`` continues to the same numbers as an
  uninterrupted run. A checkpoint of another student, teacher or configuration is
  refused;
* every ``eval_every`` steps the held-out perplexity on each of ``eval_texts``
  goes to ``heal.jsonl`` (and a figure at the end), next to the teacher's;
* a non-finite loss, or one that grows beyond ``diverge`` times the first, stops
  the run: the last checkpointed tensors are written to the output folder and the
  error says so.
"""

from __future__ import annotations

import hashlib
import math
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from flowgeom.errors import FlowgeomError, choice_error, finite_number, positive_int

OPTIMIZERS = ("adamw", "langevin")
HELD_OUT = ("kjv", "fortunes")  # scored by default: the KJV's test split and an out-of-domain text (data.ood_text)
CHECKPOINT = "checkpoint.safetensors"
LOG = "heal.jsonl"
FIGURE = "heal.png"
Progress = Callable[[str, int, int], None]  # (stage, done, total)


@dataclass(frozen=True)
class HealConfig:
    tokens: int = 102_400  # healing tokens in all: steps = tokens // (seq_len * batch), 100 by default
    seq_len: int = 256  # tokens per sequence
    batch: int = 4  # sequences per step
    lr: float = 1e-4  # peak learning rate
    warmup: float = 0.05  # fraction of the steps with a linear warm-up
    min_lr: float = 0.1  # the cosine decay ends at min_lr x lr
    optimizer: str = "adamw"  # adamw | langevin
    weight_decay: float = 0.0  # AdamW's decoupled weight decay
    temperature: float = 0.0  # langevin: the SDE's temperature s (0: regularised gradient descent)
    reg_lam: float = 1e-6  # langevin: λ of the log regulariser on every trainable matrix
    # the defaults below won at equal tokens on SmolLM2 at 20% (docs/compression.md, "Healing")
    norms: bool = True  # also train the RMSNorm gains
    train_dense: bool = True  # also train the projections the allocation left dense (factored folders)
    on_policy: float = 0.0  # fraction of each batch continued by the student's own samples (GKD-style)
    teacher_samples: float = 0.5  # fraction of each batch continued by the teacher's samples (sequence-level KD)
    sample_tokens: int | None = None  # sampled tokens ending such a sequence; None: 64, at most half of seq_len
    sample_temperature: float = 1.0  # temperature of those samples
    text: str = "kjv+pydoc"  # healing text: a shipped text's train split (data/text.py) or a UTF-8 file
    eval_texts: tuple[str, ...] = HELD_OUT  # held-out texts scored every eval_every steps
    eval_every: int = 25  # steps between held-out evaluations (and the last step)
    eval_tokens: int = 2048  # tokens of each held-out text per evaluation
    eval_context: int = 512  # window of those evaluations
    checkpoint_every: int = 25  # steps between checkpoints
    checkpointing: bool = True  # recompute the student's blocks in the backward pass (gradient checkpointing)
    diverge: float = 4.0  # a loss above diverge x the first loss stops the run
    seed: int = 0
    teacher: str | None = None  # dense model; None: the source recorded in flowgeom_share.json

    def __post_init__(self):
        for name in ("tokens", "seq_len", "batch", "eval_every", "eval_tokens", "eval_context", "checkpoint_every",
                     "sample_length"):
            positive_int(getattr(self, name), "--sample-tokens" if name == "sample_length" else f"heal {name}")
        for name in ("on_policy", "teacher_samples"):
            value = finite_number(getattr(self, name), f"--{name.replace('_', '-')}", minimum=0.0,
                                  fix="pass a fraction of the batch in [0, 1]")
            if value > 1:
                raise FlowgeomError(f"--{name.replace('_', '-')} {value} is above 1; pass a fraction of the batch in "
                                    "[0, 1]")
        if self.on_policy + self.teacher_samples > 1:
            raise FlowgeomError(f"--on-policy {self.on_policy} and --teacher-samples {self.teacher_samples} add up to "
                                "more than the whole batch; keep their sum <= 1")
        if (self.on_policy or self.teacher_samples) and self.sample_length >= self.seq_len:
            raise FlowgeomError(f"--sample-tokens {self.sample_length} leaves no text to continue in --seq-len "
                                f"{self.seq_len}; sample fewer tokens")
        finite_number(self.sample_temperature, "--sample-temperature", positive=True, fix="pass e.g. 1.0")
        if self.tokens < self.seq_len:
            raise FlowgeomError(f"--tokens {self.tokens} is less than one sequence of {self.seq_len} tokens; heal "
                                f"with at least {self.seq_len} tokens (a few hundred thousand heal a 20% model)")
        finite_number(self.lr, "--lr", positive=True, fix="pass a learning rate such as 1e-4")
        for name in ("warmup", "min_lr"):
            value = finite_number(getattr(self, name), f"heal {name}", minimum=0.0, fix="pass a fraction in [0, 1]")
            if value > 1:
                raise FlowgeomError(f"heal {name} {value} is above 1; pass a fraction in [0, 1]")
        for name in ("weight_decay", "temperature", "reg_lam"):
            finite_number(getattr(self, name), f"heal {name}", minimum=0.0, fix="pass a number >= 0")
        finite_number(self.diverge, "heal diverge", positive=True, fix="pass a factor such as 4")
        if self.optimizer not in OPTIMIZERS:
            raise choice_error("optimizer", self.optimizer, OPTIMIZERS)
        if not self.eval_texts:
            raise FlowgeomError("heal needs at least one held-out text to judge the student on (e.g. kjv)")

    @property
    def sample_length(self) -> int:
        """Sampled tokens at the end of a sampled sequence: ``sample_tokens``, by default 64 or half a sequence."""
        return self.sample_tokens if self.sample_tokens is not None else max(1, min(64, self.seq_len // 2))

    @property
    def steps(self) -> int:
        return max(1, self.tokens // (self.seq_len * self.batch_size))

    @property
    def batch_size(self) -> int:
        """Sequences per step: ``batch``, fewer when ``tokens`` is less than one batch."""
        return max(1, min(self.batch, self.tokens // self.seq_len))


# ---------------------------------------------------------------- pure pieces

def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """``KL(p_T || p_S)`` per token, averaged: logits (..., vocab) each, computed in float32 at least."""
    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    log_s = F.log_softmax(student_logits.to(dtype), dim=-1)
    log_t = F.log_softmax(teacher_logits.to(dtype), dim=-1)
    return (log_t.exp() * (log_t - log_s)).sum(-1).mean()


def learning_rate(step: int, config: HealConfig) -> float:
    """The lr of step ``step`` (0-based): linear warm-up, then cosine from ``lr`` to ``min_lr * lr``."""
    steps, warm = config.steps, int(round(config.warmup * config.steps))
    if step < warm:
        return config.lr * (step + 1) / warm
    span = max(1, steps - warm - 1)
    progress = min(1.0, (step - warm) / span)
    return config.lr * (config.min_lr + (1 - config.min_lr) * 0.5 * (1 + math.cos(math.pi * progress)))


def batch_starts(step: int, n_tokens: int, config: HealConfig) -> torch.Tensor:
    """Start offsets (batch,) of step ``step``'s sequences: a function of (seed, step) only, so a resumed run
    draws the batches an uninterrupted one draws."""
    gen = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
    return torch.randint(0, n_tokens - config.seq_len - 1, (config.batch_size,), generator=gen)


def sampled_rows(step: int, config: HealConfig) -> tuple[int, int]:
    """``(student rows, teacher rows)``: how many of step ``step``'s sequences are continued by the student's and
    by the teacher's samples; a fractional share of the batch is rounded by a draw seeded by (seed, step), so the
    fractions hold on average and a resumed run draws what an uninterrupted one draws."""
    gen = torch.Generator().manual_seed(config.seed * 1_000_003 + step + 7_919)
    u = float(torch.rand((), generator=gen))
    b = config.batch_size
    student = int(config.on_policy * b + u)
    teacher = min(b - student, int(config.teacher_samples * b + (1 - u)))
    return student, teacher


def with_samples(batch: torch.Tensor, student, teacher, step: int, config: HealConfig) -> torch.Tensor:
    """``batch`` (B, T) with the last ``sample_tokens`` tokens of its first rows replaced by samples: the
    student's own continuations (on-policy distillation: the student is trained on the states its own
    generations reach, which teacher-forced text never shows it: GKD, Agarwal et al. 2024; MiniLLM, Gu et al.
    2024), then the teacher's (sequence-level KD, Kim & Rush 2016: the teacher's distribution, not the healing
    text's). Every position is then scored by the teacher as usual (forward KL). The samples are the batch's
    *end*: one decoding step costs a read of every weight whatever the rows (memory bound on a CPU), so a
    sampled tail of 64 tokens after a long text prompt costs a quarter of a sampled 256-token sequence."""
    from flowgeom.compress.agreement import continue_tokens

    n_student, n_teacher = sampled_rows(step, config)
    if not n_student and not n_teacher:
        return batch
    gen = torch.Generator().manual_seed(config.seed * 1_000_003 + step + 104_729)
    p, out = batch.shape[1] - config.sample_length, batch.clone()
    for model, lo, hi in ((student, 0, n_student), (teacher, n_student, n_student + n_teacher)):
        if hi > lo:
            was_training = model.training
            model.eval()
            tail = continue_tokens(model, batch[lo:hi, :p], batch.shape[1] - p, temperature=config.sample_temperature,
                                   generator=gen)  # (rows, T - p)
            model.train(was_training)
            out[lo:hi, p:] = tail  # copied out of inference mode: the embedding's backward saves the ids
    return out


def hidden_states(model, ids: torch.Tensor, *, checkpointing: bool) -> torch.Tensor:
    """The model's last hidden states (B, T, d), before the final norm; each block recomputed in the backward
    pass when ``checkpointing``. Any family (:func:`flowgeom.compress.arch.runner`)."""
    from torch.utils.checkpoint import checkpoint

    from flowgeom.compress.arch import runner

    run = runner(model)
    h = run.embed(ids)  # (B, T, d)
    run.prepare(ids.shape[0], ids.shape[1], h.dtype, h.device)
    for l in range(len(run)):
        h = checkpoint(run.block, l, h, use_reentrant=False) if checkpointing else run.block(l, h)
    return h


def _chunk_kl(h_student: torch.Tensor, h_teacher: torch.Tensor, student, teacher, weight: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight x KL of the chunk, its surrogate)`` for a chunk (rows, d) of final hidden states.

    The heads are frozen, so the loss reaches the student only through its final norm's output ``n``:
    ``dKL/dlogits = (p_S - p_T) / rows`` in closed form, hence ``dKL/dn = (p_S - p_T) W_head / rows``.
    Both heads run once, without autograd; the surrogate ``<norm(h), dKL/dn>`` carries that gradient into
    the norm (and its gain, when trained) and the blocks. Autograd through the heads would run each head
    twice more (recomputed in the backward pass) and hold a (rows, vocab) graph."""
    from flowgeom.compress.arch import runner

    s_run, t_run = runner(student), runner(teacher)
    normed = s_run.norm(h_student)  # (rows, d), in the graph: the surrogate's way into the blocks
    cap = s_run.softcap
    with torch.no_grad():
        logits = s_run.lm_head(normed)  # (rows, vocab)
        if cap is not None:  # Gemma 2: logits = c tanh(z / c), so dKL/dz = dKL/dlogits (1 - (logits / c)^2)
            logits = torch.tanh(logits / cap) * cap
        target = t_run.head(h_teacher)  # (rows, vocab)
        dtype = torch.promote_types(logits.dtype, torch.float32)
        log_s, log_t = F.log_softmax(logits.to(dtype), dim=-1), F.log_softmax(target.to(dtype), dim=-1)
        p_t = log_t.exp()
        kl = (p_t * (log_t - log_s)).sum(-1).mean()
        scale = weight / h_student.shape[0]
        g_logits = (log_s.exp() - p_t).mul_(scale).to(logits.dtype)  # (rows, vocab): d(weight x KL)/dlogits
        if cap is not None:
            g_logits.mul_(1 - (logits / cap).square())
        g_normed = g_logits @ s_run.lm_head.weight  # (rows, d)
    surrogate = (normed * g_normed).sum()
    return kl * weight, surrogate


def distillation_step_loss(student, teacher, ids: torch.Tensor, *, checkpointing: bool,
                           chunk: int = 256) -> torch.Tensor:
    """``KL(p_T || p_S)`` averaged over the tokens of ``ids`` (B, T), with the vocabulary-sized logits made
    ``chunk`` token rows at a time (:func:`_chunk_kl`): a (B T, vocab) tensor never exists (at 4 x 256 tokens
    and SmolLM2's 49,152 tokens one is 200 MB, and a KL's forward and backward hold several). The value is
    the KL; its gradient, the KL's (the surrogate's value is subtracted out)."""
    h_s = hidden_states(student, ids, checkpointing=checkpointing)
    with torch.no_grad():
        h_t = hidden_states(teacher, ids, checkpointing=False)
    rows = h_s.shape[0] * h_s.shape[1]
    h_s, h_t = h_s.reshape(rows, -1), h_t.reshape(rows, -1)  # (B T, d)
    value = h_s.new_zeros(())
    surrogate = h_s.new_zeros(())
    for a in range(0, rows, chunk):
        kl, sur = _chunk_kl(h_s[a: a + chunk], h_t[a: a + chunk], student, teacher, min(chunk, rows - a) / rows)
        value, surrogate = value + kl, surrogate + sur
    return value + (surrogate - surrogate.detach())


# ---------------------------------------------------------------- the student on disk

@dataclass
class Student:
    """A compressed folder loaded for training: the model, its trainable tensors by their names on disk, and
    what is needed to write it back (every tensor of the folder, the JSON files)."""

    folder: Path
    kind: str  # factored | dense
    model: torch.nn.Module
    trainable: dict[str, torch.nn.Parameter]
    dtypes: dict[str, torch.dtype]  # every tensor of the folder and the dtype it is stored in (read back at write)
    report: dict[str, Any]
    config_json: dict[str, Any]
    extra: dict[str, dict] = field(default_factory=dict)


def _compression_report(folder: Path) -> dict[str, Any]:
    from flowgeom.files import read_json_object

    path = folder / "flowgeom_share.json"
    if not folder.is_dir() or not path.is_file():
        raise FlowgeomError(f"{folder} is not a compressed folder (no flowgeom_share.json); heal takes a folder "
                            "written by `flowgeom compress run` (factored, or with dropped blocks)")
    return read_json_object(path, fix="write the folder again with `flowgeom compress run`")


def load_student(folder: str | Path, *, norms: bool = False, train_dense: bool = False) -> Student:
    """The compressed model in ``folder`` with its trainable tensors (module docstring)."""
    from flowgeom.compress.arch import arch_of
    from flowgeom.compress.folder import JSON_NAME, is_factored, load_model, read_factored
    from flowgeom.files import read_json_object
    from flowgeom.io.sources import open_source
    from flowgeom.nn.llama import load_llama

    folder = Path(folder)
    report = _compression_report(folder)
    config_json = read_json_object(folder / "config.json", fix="write the folder again")
    if is_factored(folder):
        _, units, tensors = read_factored(folder)
        dtypes = {name: t.dtype for name, t in tensors.items()}
        del tensors  # the model holds its own; the rest is read back when the healed folder is written
        model = load_model(folder)
        arch = arch_of(model.config)
        trainable: dict[str, torch.nn.Parameter] = {}
        for u in units:
            for layer, coeff in zip(u.layers, u.coeffs):
                module = model.get_submodule(f"{arch.layers}.{layer}.{arch.slots[u.role].path}")
                module = module.parts[u.role] if hasattr(module, "parts") else module  # a split fused projection
                trainable[u.basis] = module.basis
                trainable[coeff] = module.coeff
        kind = "factored"
        extra = {JSON_NAME: read_json_object(folder / JSON_NAME, fix="write the folder again")}
        if train_dense:  # the projections the allocation left dense: the folder's other matrices inside the blocks
            trainable.update({name: p for name, p in model.named_parameters()
                              if name.startswith(f"{arch.layers}.") and p.ndim == 2 and name in dtypes
                              and name not in trainable})
    elif report.get("format") == "dense" and str(report.get("method", "")).startswith("drop"):
        src = open_source(folder / "model.safetensors")
        dtypes = {name: src.load(name).dtype for name in src.shapes}
        model = load_llama(folder)
        trainable = {name: p for name, p in model.named_parameters()
                     if name.startswith("model.layers.") and name.endswith("_proj.weight")}
        kind, extra = "dense", {}
    else:
        raise FlowgeomError(f"{folder} is neither factored nor a model with dropped blocks ({report.get('method')!r}, "
                            f"{report.get('format')!r}); heal takes what `compress run` writes without --dense")
    if norms:
        trainable.update({name: p for name, p in model.named_parameters() if name.endswith("norm.weight")})
    for p in model.parameters():
        p.requires_grad_(False)
    for p in trainable.values():
        p.requires_grad_(True)
    return Student(folder, kind, model, trainable, dtypes, report, config_json, extra)


def student_identity(folder: Path, teacher: str) -> str:
    """sha256 of what makes a student: config.json, the factored JSON, the safetensors header (names, shapes,
    dtypes, offsets) and the teacher's name. A resume against another model or plan sees another digest."""
    from flowgeom.compress.folder import JSON_NAME, weights_path

    h = hashlib.sha256(teacher.encode())
    for name in ("config.json", JSON_NAME):
        if (folder / name).is_file():
            h.update((folder / name).read_bytes())
    with open(weights_path(folder), "rb") as fh:
        size = int.from_bytes(fh.read(8), "little")
        h.update(fh.read(min(size, 1 << 26)))
    return h.hexdigest()


def healed_tensors(student: Student) -> dict[str, torch.Tensor]:
    """Every tensor of the folder, the trained ones replaced (each in the dtype it was stored in)."""
    from flowgeom.compress.folder import weights_path
    from flowgeom.io.sources import open_source

    src = open_source(weights_path(student.folder))
    out = {name: src.load(name) for name in student.dtypes if name not in student.trainable}
    for name, p in student.trainable.items():
        out[name] = p.detach().to(student.dtypes[name]).contiguous()
    return out


def original_tensors(student: Student) -> dict[str, torch.Tensor]:
    """The trainable tensors as the folder stores them (the start of the run)."""
    from flowgeom.compress.folder import weights_path
    from flowgeom.io.sources import open_source

    src = open_source(weights_path(student.folder))
    return {name: src.load(name) for name in student.trainable}


def share_frozen(student: torch.nn.Module, teacher: torch.nn.Module) -> int:
    """Point the student's untrained token embedding and head at the teacher's when they are equal (they are
    copies of the same tensor: a factored folder keeps them as they were): one copy in memory, not two.
    Returns the numbers saved."""
    from flowgeom.compress.arch import runner

    saved = 0
    mine_run, their_run = runner(student), runner(teacher)
    for mine, theirs in ((mine_run.embedding, their_run.embedding), (mine_run.lm_head, their_run.lm_head)):
        a, b = mine.weight, theirs.weight
        if a is b or a.requires_grad or a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b):
            continue
        mine.weight = b
        saved += a.numel()
    if student.config.tie_word_embeddings:
        mine_run.lm_head.weight = mine_run.embedding.weight
    return saved


# ---------------------------------------------------------------- the run

def _held_out_ids(name: str, tokenizer, tokens: int) -> torch.Tensor:
    from flowgeom.data.text import load_text
    from flowgeom.data.tokens import token_ids

    text = load_text(name, split="test")
    return token_ids(text, tokenizer)[:tokens]


def _healing_ids(config: HealConfig, tokenizer) -> torch.Tensor:
    from flowgeom.data.text import check_text, load_text
    from flowgeom.data.tokens import token_ids

    check_text(config.text, "--heal-text")
    text = load_text(config.text, split="train")
    ids = token_ids(text, tokenizer)
    if len(ids) < config.seq_len + 2:
        raise FlowgeomError(f"the healing text has {len(ids)} tokens, fewer than one sequence of {config.seq_len}; "
                            "pass a longer --text or a shorter --seq-len")
    return ids


def _optimizer(config: HealConfig, trainable: Mapping[str, torch.nn.Parameter]) -> torch.optim.Optimizer:
    if config.optimizer == "adamw":
        return torch.optim.AdamW(list(trainable.values()), lr=config.lr, betas=(0.9, 0.95),
                                 weight_decay=config.weight_decay, foreach=True)
    from flowgeom.langevin import Langevin, Regularizer

    reg = Regularizer("log", lam=config.reg_lam) if config.reg_lam > 0 else Regularizer("none")
    return Langevin(list(trainable.items()), lr=config.lr, temperature=config.temperature, seed=config.seed,
                    grad_transform=reg.transform(list(trainable)))


def _evaluate(model, held_out: Mapping[str, torch.Tensor], context: int) -> dict[str, float]:
    from flowgeom.compress.perplexity import EvalConfig, perplexity

    model.eval()
    context = min(context, model.config.max_position_embeddings)
    out = {name: perplexity(model, ids, EvalConfig(context=min(context, len(ids)), max_tokens=None))["ppl"]
           for name, ids in held_out.items()}
    model.train()
    return out


def _heal_figure(history: Sequence[Mapping[str, Any]], reference: Mapping[str, float], path: Path) -> None:
    from flowgeom.report.figures import new_figure
    from flowgeom.files import atomic_write_figure

    fig = new_figure(figsize=(5.5, 3.4))
    ax = fig.add_subplot()
    for name, ref in reference.items():
        points = [(h["tokens"], h["ppl"][name] / ref) for h in history if "ppl" in h]
        ax.plot([t for t, _ in points], [r for _, r in points], marker="o", ms=3, label=f"{name} (held out)")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--", label="dense teacher")
    ax.set_xlabel("healing tokens")
    ax.set_ylabel("perplexity / teacher's")
    ax.set_title("healing by distillation")
    ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_write_figure(path, fig, root=path.parent)


@dataclass
class _Run:
    """What a step loop carries: the position, the history (one record per evaluation) and the step of the last
    good tensors (the last checkpoint's, on disk; 0 = the folder's own)."""

    step: int
    history: list[dict[str, Any]]
    good_step: int
    first_loss: float | None = None


def _checkpoint(work: Path, run: _Run, student: Student, opt: torch.optim.Optimizer, identity: str,
                config: HealConfig) -> None:
    """The run's state, streamed tensor by tensor into flowgeom's checkpoint format (no copy of the parameters
    or of the optimiser's moments in memory: at SmolLM2 scale a copy is a gigabyte)."""
    from flowgeom.compress.write import stream_safetensors
    from flowgeom.runs import atomic_write, checkpoint_parts

    state = {"identity": identity, "config": _config_record(config), "step": run.step, "history": run.history,
             "first_loss": run.first_loss, "trainable": dict(student.trainable), "optimizer": opt.state_dict()}
    meta, tensors = checkpoint_parts(state, copy=False)
    atomic_write(work / CHECKPOINT, lambda fh: stream_safetensors(fh, tensors, meta), root=work)
    run.good_step = run.step


def _read_checkpoint(work: Path) -> dict[str, Any]:
    from flowgeom.files import read_regular
    from flowgeom.runs import decode_checkpoint

    path = work / CHECKPOINT
    return decode_checkpoint(read_regular(path, CHECKPOINT, fix="delete it and heal again", limit=1 << 36),
                             source=str(path))


def _restore_good(work: Path, run: _Run, student: Student) -> None:
    """The trainable tensors of the last good step: the last checkpoint's, or the folder's own."""
    good = _read_checkpoint(work)["trainable"] if run.good_step > 0 else original_tensors(student)
    with torch.no_grad():
        for name, p in student.trainable.items():
            p.copy_(good[name])


def _config_record(config: HealConfig) -> dict[str, Any]:
    """The fields that decide the numbers (the evaluation cadence included: the history depends on it)."""
    record = asdict(config)
    record["eval_texts"] = list(config.eval_texts)
    return record


def _resume(work: Path, student: Student, opt: torch.optim.Optimizer, identity: str, config: HealConfig) -> _Run:
    path = work / CHECKPOINT
    state = _read_checkpoint(work)
    if state.get("identity") != identity:
        raise FlowgeomError(f"{path} belongs to another student or teacher (another model or plan); heal this "
                            "folder without --resume, or resume the folder it came from")
    if state.get("config") != _config_record(config):
        theirs = state.get("config") or {}
        diff = sorted(k for k in set(theirs) | set(_config_record(config))
                      if theirs.get(k) != _config_record(config).get(k))
        raise FlowgeomError(f"{path} was written with other heal settings ({', '.join(diff)}); resume with the same "
                            "settings, or heal again without --resume")
    with torch.no_grad():
        for name, p in student.trainable.items():
            p.copy_(state["trainable"][name])
    opt.load_state_dict(state["optimizer"])
    return _Run(state["step"], list(state["history"]), state["step"], state["first_loss"])


def heal_folder(folder: str | Path, out: str | Path, config: HealConfig, *, force: bool = False,
                resume: bool = False, in_place: bool = False, progress: Progress | None = None,
                on_eval: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Heal the compressed ``folder`` into the folder ``out`` (module docstring); returns the heal report.

    The run's state lives in ``<out>.heal/`` (checkpoint, ``heal.jsonl``) until the healed folder is written
    (then it is removed; a diverged run keeps it); ``heal.jsonl``, ``heal.json`` and ``heal.png`` go into ``out``. ``in_place`` allows ``out == folder`` (``compress
    run --heal``: the folder is read whole before it is replaced).
    """
    from flowgeom.compress.folder import JSON_NAME, WEIGHTS_NAME, factored_config_json
    from flowgeom.compress.folder import load_model as load_any
    from flowgeom.compress.source import source_path
    from flowgeom.compress.write import check_out_folder, save_llama_folder, write_folder, write_model_files
    from flowgeom.data.tokens import load_tokenizer
    from flowgeom.files import out_folder
    from flowgeom.runs import atomic_write_bytes, atomic_write_json, to_json

    t0 = time.perf_counter()
    folder, out = Path(folder), Path(out)
    report = _compression_report(folder)  # not compressed: refused before anything else
    if not (in_place and out.resolve() == folder.resolve()):
        check_out_folder(folder, out, force=force)
    work = out.parent / f"{out.name}.heal"
    if resume and not (work / CHECKPOINT).is_file():
        raise FlowgeomError(f"--resume: {work / CHECKPOINT} does not exist; heal without --resume to start")
    teacher_spec = config.teacher or report.get("source")
    if not isinstance(teacher_spec, str) or not teacher_spec:
        raise FlowgeomError(f"{folder}/flowgeom_share.json names no source model; pass --teacher")
    teacher_path = source_path(teacher_spec)
    tokenizer = load_tokenizer(folder if (folder / "tokenizer.json").is_file() else teacher_path)
    ids = _healing_ids(config, tokenizer)
    held_out = {name: _held_out_ids(name, tokenizer, config.eval_tokens) for name in config.eval_texts}

    student = load_student(folder, norms=config.norms, train_dense=config.train_dense)
    teacher = load_any(teacher_path).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    if teacher.config.vocab_size != student.model.config.vocab_size:
        raise FlowgeomError(f"the teacher {teacher_spec} has {teacher.config.vocab_size} tokens, the student "
                            f"{student.model.config.vocab_size}; pass the --teacher the folder was compressed from")
    if config.seq_len > student.model.config.max_position_embeddings:
        raise FlowgeomError(f"--seq-len {config.seq_len} exceeds the model's {student.model.config.max_position_embeddings} "
                            "positions; pass a shorter --seq-len")
    identity = student_identity(folder, str(teacher_path.resolve()))
    opt = _optimizer(config, student.trainable)
    work = out_folder(work.parent, work, "the heal work folder")
    run = _resume(work, student, opt, identity, config) if resume else _Run(0, [], 0)
    share_frozen(student.model, teacher)
    reference = _evaluate(teacher, held_out, config.eval_context)
    student.model.train()
    if not run.history:
        run.history.append({"step": 0, "tokens": 0, "ppl": _evaluate(student.model, held_out, config.eval_context),
                            "seconds": 0.0})
        if on_eval:
            on_eval({**run.history[-1], "reference": reference})
    tokens_per_step = config.seq_len * config.batch_size
    stop: str | None = None
    losses: list[float] = []
    t_steps, steps_timed = time.perf_counter(), 0
    while run.step < config.steps:
        k = run.step
        lr = learning_rate(k, config)
        for group in opt.param_groups:
            group["lr"] = lr
        starts = batch_starts(k, len(ids), config)
        batch = torch.stack([ids[s: s + config.seq_len] for s in starts.tolist()]).long()  # (B, T)
        batch = with_samples(batch, student.model, teacher, k, config)
        loss = distillation_step_loss(student.model, teacher, batch, checkpointing=config.checkpointing)
        value = float(loss.detach())
        if run.first_loss is None:
            run.first_loss = value
        if not math.isfinite(value) or value > config.diverge * max(run.first_loss, 1e-3):
            stop = (f"healing diverged at step {k + 1} (KL {value:.4g}, first {run.first_loss:.4g}); the tensors of "
                    f"step {run.good_step} were kept; lower --lr (now {config.lr:g})")
            break
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)  # the gradients' memory is free during the next forward
        del loss
        run.step += 1
        steps_timed += 1
        losses.append(value)
        if progress:
            progress("heal", run.step, config.steps)
        last = run.step == config.steps
        if run.step % config.eval_every == 0 or last:
            elapsed = time.perf_counter() - t_steps
            record = {"step": run.step, "tokens": run.step * tokens_per_step, "kl": sum(losses) / len(losses),
                      "lr": lr, "ppl": _evaluate(student.model, held_out, config.eval_context),
                      "step_seconds": elapsed / max(steps_timed, 1),
                      "tokens_per_s": steps_timed * tokens_per_step / max(elapsed, 1e-9),
                      "seconds": time.perf_counter() - t0}
            run.history.append(record)
            losses = []
            if on_eval:
                on_eval({**record, "reference": reference})
            atomic_write_bytes(work / LOG, "".join(to_json(h) + "\n" for h in run.history).encode(), root=work)
            t_steps, steps_timed = time.perf_counter(), 0
        if run.step % config.checkpoint_every == 0 or last:
            _checkpoint(work, run, student, opt, identity, config)
    if stop is not None:
        _restore_good(work, run, student)

    heal = {"teacher": teacher_spec, "config": _config_record(config), "steps": run.good_step if stop else run.step,
            "tokens": (run.good_step if stop else run.step) * tokens_per_step, "reference_ppl": reference,
            "history": run.history, "diverged": stop, "seconds": time.perf_counter() - t0}
    final = next((h for h in reversed(run.history) if h["step"] <= heal["steps"]), run.history[0])
    heal["ppl"] = final["ppl"]
    heal["ppl_ratio"] = {name: final["ppl"][name] / reference[name] for name in reference}
    new_report = {**student.report, "heal": heal, "out": str(out)}

    def fill(tmp: Path) -> None:
        tensors = healed_tensors(student)
        if student.kind == "factored":
            write_model_files(tmp, tensors, factored_config_json(student.config_json), tokenizer=tokenizer,
                              report=new_report, extra={JSON_NAME: student.extra[JSON_NAME]}, weights=WEIGHTS_NAME)
        else:
            save_llama_folder(tmp, student.config_json, tensors, tokenizer=tokenizer, report=new_report)
        atomic_write_bytes(tmp / LOG, "".join(to_json(h) + "\n" for h in run.history).encode(), root=tmp)
        _heal_figure(run.history, reference, tmp / FIGURE)
        atomic_write_json(tmp / "heal.json", heal, root=tmp)

    write_folder(out, fill, force=force or in_place)
    if stop is not None:
        raise FlowgeomError(f"{stop}; written to {out}")
    shutil.rmtree(work, ignore_errors=True)  # done: heal.jsonl and heal.json are in out; the checkpoint is spent
    return heal
