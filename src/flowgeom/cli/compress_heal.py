"""``flowgeom compress heal``: distil the dense model back into a compressed folder; its flags, which
``compress run --heal`` and ``compress sweep --heal`` take too.

The healing lives in :mod:`flowgeom.compress.heal`; this module parses, validates, calls and prints.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flowgeom.cli._common import (
    add_json, add_threads, bounded_int, command, console, finite_float, positive_int, print_json,
)

DEFAULT_TOKENS = 102_400  # flowgeom.compress.heal.HealConfig.tokens (kept here: --help imports no torch)


def heal_config(args: argparse.Namespace, tokens: int):
    """The :class:`~flowgeom.compress.heal.HealConfig` of the heal flags (also those of ``compress run --heal``)."""
    from flowgeom.compress.heal import HELD_OUT, HealConfig

    return HealConfig(tokens=tokens, seq_len=args.seq_len, batch=args.heal_batch, lr=args.lr,
                      optimizer=args.optimizer, temperature=args.temperature, norms=args.norms,
                      train_dense=args.train_dense, on_policy=args.on_policy, teacher_samples=args.teacher_samples,
                      sample_tokens=args.sample_tokens,
                      text=args.heal_text, eval_texts=tuple(args.eval_texts or HELD_OUT), eval_every=args.eval_every,
                      eval_tokens=args.eval_tokens_heal, checkpoint_every=args.checkpoint_every, seed=args.seed,
                      teacher=args.teacher)


def heal_printer(enabled: bool):
    """One line per held-out evaluation: step, tokens, KL, perplexity (× teacher) per text, tokens/s, ETA."""
    def show(record: dict) -> None:
        if not enabled:
            return
        ref = record["reference"]
        ppl = "  ".join(f"{name} {p:.2f} ({p / ref[name]:.3f}x)" for name, p in record["ppl"].items())
        speed = (f"  {record['tokens_per_s']:.0f} tok/s, {record['step_seconds']:.2f} s/step"
                 if "tokens_per_s" in record else "")
        kl = f"  KL {record['kl']:.4f}" if "kl" in record else ""
        print(f"heal: step {record['step']}, {record['tokens']:,} tokens{kl}  ppl {ppl}{speed}", file=sys.stderr,
              flush=True)
    return show


def run_heal(args: argparse.Namespace) -> int:
    from flowgeom.cli.progress import stage_progress
    from flowgeom.compress.heal import heal_folder

    config = heal_config(args, args.tokens)  # every option checked before any work
    with stage_progress(not args.json, prefix="compress heal") as update:
        result = heal_folder(Path(args.folder), Path(args.out), config, force=args.force, resume=args.resume,
                             progress=update, on_eval=heal_printer(not args.json))
    if args.json:
        print_json(result)
    else:
        ratios = ", ".join(f"{name} {r:.3f}x" for name, r in result["ppl_ratio"].items())
        console().print(f"{args.folder} -> {args.out}: healed on {result['tokens']:,} tokens in "
                        f"{result['seconds']:.0f} s; perplexity / teacher's: {ratios}; log {args.out}/heal.jsonl, "
                        f"figure {args.out}/heal.png")
    return 0


def add_heal_flags(p: argparse.ArgumentParser, *, tokens_flag: str | None) -> None:
    """The heal options, for ``compress heal`` (``tokens_flag`` = ``--tokens``) and ``run``/``sweep --heal``."""
    if tokens_flag:
        p.add_argument(tokens_flag, type=positive_int, default=DEFAULT_TOKENS,
                       help=f"healing tokens in all (default {DEFAULT_TOKENS:,}); at least one sequence")
    p.add_argument("--lr", type=finite_float(0.0, 1.0, lo_open=True), default=1e-4,
                   help="peak learning rate, after a linear warm-up over 5%% of the steps, then cosine to 10%% "
                        "(default 1e-4)")
    p.add_argument("--optimizer", choices=("adamw", "langevin"), default="adamw",
                   help="adamw (default, betas 0.9/0.95) or langevin (flowgeom's SDE with the seed-004 log "
                        "regulariser on every factor)")
    p.add_argument("--temperature", type=finite_float(0.0), default=0.0,
                   help="--optimizer langevin: the SDE's temperature (default 0: regularised gradient descent)")
    p.add_argument("--norms", action=argparse.BooleanOptionalAction, default=True,
                   help="also train the RMSNorm gains (default: yes)")
    p.add_argument("--train-dense", action=argparse.BooleanOptionalAction, default=True,
                   help="also train the projections the rank allocation left dense (default: yes)")
    p.add_argument("--on-policy", type=finite_float(0.0, 1.0), default=0.0, metavar="FRACTION",
                   help="fraction of each batch whose last --sample-tokens tokens are the student's own samples, "
                        "scored by the teacher (on-policy distillation; default 0)")
    p.add_argument("--teacher-samples", type=finite_float(0.0, 1.0), default=0.5, metavar="FRACTION",
                   help="fraction of each batch whose last --sample-tokens tokens are the teacher's samples "
                        "(sequence-level KD; default 0.5)")
    p.add_argument("--sample-tokens", type=bounded_int(1, 1 << 16),
                   help="sampled tokens at the end of a sampled sequence, after its text prompt (default 64, at "
                        "most half of --seq-len)")
    p.add_argument("--heal-text", default="kjv+pydoc", metavar="TEXT",
                   help="healing text: the train split of kjv, pydoc, a mix such as kjv+pydoc (default: the KJV and "
                        "the Python reference's prose, chunk for chunk), or a UTF-8 file; never the held-out text")
    p.add_argument("--eval-texts", type=lambda s: tuple(x for x in s.split(",") if x), metavar="T1,T2",
                   help="held-out texts scored while healing: kjv (its test split), fortunes (out of domain) or "
                        "files (default kjv,fortunes)")
    p.add_argument("--seq-len", type=bounded_int(8, 1 << 16), default=256, help="tokens per sequence (default 256)")
    p.add_argument("--heal-batch", type=positive_int(maximum=4096), default=4, help="sequences per step (default 4)")
    p.add_argument("--eval-every", type=positive_int, default=25, help="steps between evaluations (default 25)")
    p.add_argument("--eval-tokens-heal", type=bounded_int(16), default=2048, metavar="N",
                   help="held-out tokens of each text per evaluation (default 2048)")
    p.add_argument("--checkpoint-every", type=positive_int, default=25, help="steps between checkpoints (default 25)")
    p.add_argument("--seed", type=bounded_int(0, 2**31 - 1), default=0, help="batch order seed (default 0)")
    p.add_argument("--teacher", help="the dense model (default: the source recorded in flowgeom_share.json)")


def register_heal(verbs) -> None:
    """Add ``heal`` to the ``compress`` area's verb sub-parsers."""
    p = command(verbs, "heal", help="distil the dense model's logits into a compressed folder (factors, or the "
                                    "blocks left after dropping)",
                example="flowgeom compress run builtin:smollm2 --out runs/w20 --budget 0.2\n"
                        "flowgeom compress heal runs/w20 --out runs/w20-healed --tokens 200000\n"
                        "flowgeom compress heal runs/w20 --out runs/w20-healed --tokens 200000 --resume",
                func=run_heal)
    p.add_argument("folder", help="a folder written by `flowgeom compress run` (factored or dropped blocks)")
    p.add_argument("--out", required=True, help="new folder for the healed model; the run's state goes to OUT.heal/")
    add_heal_flags(p, tokens_flag="--tokens")
    p.add_argument("--resume", action="store_true", help="continue from OUT.heal/checkpoint.safetensors")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out folder")
    add_threads(p)
    add_json(p)
