"""A compressed folder against its dense source, as a user runs them: transformers models, prefill and decode.

    .venv/bin/python benchmarks/factored_speed.py FOLDER [--repeats 5] [--prompt 512] [--new-tokens 128]

Both models are ``transformers.LlamaForCausalLM`` in float32: the factored one from
``flowgeom.compress.load(FOLDER)``, the dense one built from the source that
``FOLDER/flowgeom_share.json`` names (its own weights, dequantised when it is a GGUF).

* prefill: one ``--prompt``-token sequence -> the KV cache and the last position's logits
  (``logits_to_keep=1``, what generation needs);
* decode: batch 1, ``--new-tokens`` greedy tokens with the KV cache after an 8-token prompt,
  time per new token;

each at 1 BLAS thread and at all threads, dense and factored interleaved ``--repeats`` times in one
process; the median of each and their ratio are printed. Bytes: the folder's safetensors against the
dense model's parameters in the folder's dtype (tied embeddings once), and against the source file when
that is quantised.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch


def dense_hf(source: str):
    """transformers' LlamaForCausalLM holding the dense source's weights (flowgeom's names are HF's)."""
    import transformers

    from flowgeom.compress.folder import load_model
    from flowgeom.compress.source import source_path

    ours = load_model(source_path(source))
    hf_cfg = transformers.LlamaConfig(**{k: v for k, v in ours.config.to_hf().items() if k != "architectures"})
    model = transformers.LlamaForCausalLM(hf_cfg)
    model.load_state_dict(ours.state_dict(), strict=False)
    if hf_cfg.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


def params_bytes(model: torch.nn.Module, dtype: torch.dtype) -> int:
    seen, total = set(), 0
    for p in model.parameters():  # parameters() yields a tied tensor once
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * torch.empty((), dtype=dtype).element_size()
    return total


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("folder")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args()
    from flowgeom.compress import load
    from flowgeom.compress.folder import weights_path
    from flowgeom.compress.source import source_path

    folder = Path(args.folder)
    report = json.loads((folder / "flowgeom_share.json").read_text())
    models = {"dense": dense_hf(report["source"]), "factored": load(folder)}
    vocab = models["dense"].config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (1, args.prompt), generator=gen)
    short = torch.randint(0, vocab, (1, 8), generator=gen)

    def prefill(m):
        with torch.inference_mode():
            m(prompt, use_cache=True, logits_to_keep=1)

    def decode(m):
        with torch.inference_mode():
            m.generate(short, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                       pad_token_id=0)

    threads_all = os.cpu_count() or 1
    print(f"{folder}: {args.prompt}-token prefill, {args.new_tokens}-token decode; median of {args.repeats}, "
          f"interleaved; load {os.getloadavg()[0]:.1f}")
    for threads in sorted({1, threads_all}):
        torch.set_num_threads(threads)
        for name, fn, per in (("prefill", prefill, 1), ("decode", decode, args.new_tokens)):
            for m in models.values():
                fn(m)  # warm-up
            times = {k: [] for k in models}
            for _ in range(args.repeats):
                for k, m in models.items():
                    times[k].append(timed(lambda: fn(m)) / per)
            d, f = statistics.median(times["dense"]), statistics.median(times["factored"])
            unit = "s" if per == 1 else "s/token"
            print(f"  {name:8s} {threads:2d} thread(s): dense {d:.4f} {unit}, factored {f:.4f} {unit}, "
                  f"ratio {f / d:.3f}")
    size = weights_path(folder).stat().st_size
    dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(report.get("dtype"), torch.float32)
    dense_bytes = params_bytes(models["dense"], dtype)
    print(f"  bytes: {weights_path(folder).name} {size / 1e6:.1f} MB, the dense model in "
          f"{report.get('dtype', 'float32')} "
          f"{dense_bytes / 1e6:.1f} MB: ratio {size / dense_bytes:.3f}")
    src = source_path(report["source"])
    if src.suffix == ".gguf":
        print(f"  the source {report['source']} is a quantised GGUF of {src.stat().st_size / 1e6:.1f} MB: "
              f"{size / src.stat().st_size:.2f}x the factored folder's size is what a user holding the GGUF pays")


if __name__ == "__main__":
    main()
