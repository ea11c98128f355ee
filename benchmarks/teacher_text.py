"""A healing text written by the dense model itself (issue 40): its samples from the start token, cached once.

    .venv/bin/python benchmarks/teacher_text.py --out runs/teacher.txt --tokens 102400
    flowgeom compress heal runs/sweep-b0.1 --out runs/b01-teacher --heal-text runs/teacher.txt --tokens 51200

The heal's own texts (KJV, the Python reference) are two narrow domains, and the judge's prompts (fortunes)
are a third. The dense model's unconditioned samples are as broad as what it learnt, and no prompt of theirs
comes from the judge's text. Rows of ``--length`` tokens are sampled at ``--temperature`` (default 1: the
teacher's own distribution, what sequence-level distillation fits), ``--batch`` rows at a time with a KV
cache, and written as UTF-8, one sample a paragraph.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from flowgeom.compress import load
from flowgeom.compress.agreement import continue_tokens
from flowgeom.compress.source import model_tokenizer, source_path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", default="builtin:smollm2")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=102_400, help="sampled tokens in all")
    ap.add_argument("--length", type=int, default=256, help="tokens per sample")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    model = load(args.source).eval()
    tokenizer = model_tokenizer(source_path(args.source))
    start = model.config.bos_token_id
    generator = torch.Generator().manual_seed(args.seed)
    rows, t0 = [], time.perf_counter()
    with torch.inference_mode():
        while len(rows) * args.length < args.tokens:
            prompt = torch.full((args.batch, 1), start, dtype=torch.long)
            sampled = continue_tokens(model, prompt, args.length, temperature=args.temperature, generator=generator)
            rows += [tokenizer.decode(r.tolist()).strip() for r in sampled]
            print(f"{len(rows) * args.length:,} tokens sampled, {time.perf_counter() - t0:.0f} s", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n\n".join(r for r in rows if r) + "\n", encoding="utf-8")
    print(f"{args.out}: {len(rows)} samples, {args.out.stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
