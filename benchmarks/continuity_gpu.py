"""Llama-3.1-8B-shaped projections (32 layers x 7 roles, bf16): analyzer vs full-spectrum SVD.

    .venv/bin/python benchmarks/continuity_gpu.py --device cuda            # on a GPU (full size)
    .venv/bin/python benchmarks/continuity_gpu.py --scale 0.0625 --layers 8  # CPU, shrunk

Shapes (scale 1): q, o 4096x4096; k, v 1024x4096 (GQA); gate, up 14336x4096;
down 4096x14336. Weights are synthetic bf16 generated on the device: a
Gaussian bulk plus 16 spikes whose directions drift slowly across layers
(trained weights are spiked; pure noise is the Krylov worst case and says
nothing about real checkpoints). Reports the analyzer's compute time (data
already on the device, float32 compute, ``--batch`` layers per call), a
full float32 SVD of every matrix unless ``--no-svd`` (issue 5: ~160 s on an
H200; target for the analyzer < 5 s), and the largest |cos v1| difference.
"""

from __future__ import annotations

import argparse
import time

import torch

from flowgeom.continuity import AnalyzeConfig, analyze

ROLES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
         "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


def shapes(scale: float) -> dict[str, tuple[int, int]]:
    d, kv, h = (max(8, int(x * scale)) for x in (4096, 1024, 14336))
    return {"q": (d, d), "k": (kv, d), "v": (kv, d), "o": (d, d), "gate": (h, d), "up": (h, d), "down": (d, h)}


def make_state(layers: int, scale: float, device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    sd = {}
    for role, (m, n) in shapes(scale).items():
        u = torch.randn(m, 16, generator=g, device=device)
        v = torch.randn(n, 16, generator=g, device=device)
        spikes = torch.logspace(0.8, 0.2, 16, device=device)
        for i in range(layers):
            u = torch.nn.functional.normalize(u + 0.3 * torch.randn(m, 16, generator=g, device=device), dim=0)
            v = torch.nn.functional.normalize(v + 0.3 * torch.randn(n, 16, generator=g, device=device), dim=0)
            bulk = torch.randn(m, n, generator=g, device=device) / (m ** 0.5 + n ** 0.5)
            sd[f"model.layers.{i}.{ROLES[role]}.weight"] = (bulk + (u * spikes) @ v.T).to(torch.bfloat16)
    return sd


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--scale", type=float, default=None, help="shrink every dim (default 1 on cuda, 1/16 on cpu)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4, help="layers per batched call")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--no-svd", action="store_true", help="skip the full-SVD comparison")
    ap.add_argument("--no-gram", action="store_true", help="analyzer without the sigma^2-Gram similarity")
    args = ap.parse_args()
    device = torch.device(args.device)
    scale = args.scale if args.scale is not None else (1.0 if device.type == "cuda" else 1 / 16)
    sd = make_state(args.layers, scale, device)
    gb = sum(t.numel() * 2 for t in sd.values()) / 1e9
    cfg = AnalyzeConfig(k=args.k, device=str(device), dtype="float32", batch=args.batch, gram=not args.no_gram)
    if device.type == "cuda":  # warm-up (kernels, cuSOLVER handles) on two layers
        analyze({k: v for k, v in sd.items() if ".layers.0." in k or ".layers.1." in k}, cfg)
    sync(device)
    t0 = time.perf_counter()
    report = analyze(sd, cfg)
    sync(device)
    t_fast = time.perf_counter() - t0
    print(f"{args.layers} layers x 7 roles, scale {scale:g} ({gb:.1f} GB bf16) on {device}: "
          f"analyzer {t_fast:.2f}s (k={args.k}, batch {args.batch}, float32{', no gram' if args.no_gram else ''})")
    if args.no_svd:
        return
    t0 = time.perf_counter()
    diff = 0.0
    for role, r in report["roles"].items():
        prev = None
        for i, layer in enumerate(r["layers"]):
            W = sd[f"model.layers.{layer}.{ROLES[role]}.weight"].float()
            _, _, Vh = torch.linalg.svd(W, full_matrices=False)
            if prev is not None:
                diff = max(diff, abs(float((prev @ Vh[0]).abs()) - r["pairs"][i - 1]["v1"]))
            prev = Vh[0]
    sync(device)
    t_svd = time.perf_counter() - t0
    print(f"full float32 SVD of the same {7 * args.layers} matrices: {t_svd:.2f}s  -> speed-up {t_svd / t_fast:.1f}x; "
          f"max |cos v1| difference {diff:.1e}")


if __name__ == "__main__":
    main()
