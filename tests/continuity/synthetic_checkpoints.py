"""Synthetic checkpoints for the continuity tests (built in tmp_path, tiny)."""

from __future__ import annotations

import torch

LLAMA = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
         "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


def llama_state(layers: int = 3, d: int = 16, kv: int = 8, hidden: int = 24, seed: int = 0) -> dict[str, torch.Tensor]:
    """A tiny Llama-like (GQA: k/v have ``kv`` rows) state dict with HF names, random weights."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"q": (d, d), "k": (kv, d), "v": (kv, d), "o": (d, d), "gate": (hidden, d), "up": (hidden, d),
              "down": (d, hidden)}
    out = {"model.embed_tokens.weight": torch.randn(10, d, generator=g)}
    for layer in range(layers):
        out[f"model.layers.{layer}.input_layernorm.weight"] = torch.ones(d)
        for role, name in LLAMA.items():
            out[f"model.layers.{layer}.{name}.weight"] = torch.randn(*shapes[role], generator=g)
    return out


def planted_stack(layers: int, m: int, n: int, *, shared: str, seed: int = 0, strength: float = 6.0) -> torch.Tensor:
    """Layers ``noise + strength * u v^T`` sharing v (``shared="in"``), u ("out"), or nothing ("none")."""
    g = torch.Generator().manual_seed(seed)
    u0, v0 = torch.randn(m, generator=g), torch.randn(n, generator=g)
    u0, v0 = u0 / u0.norm(), v0 / v0.norm()
    mats = []
    for _ in range(layers):
        u = u0 if shared == "out" else torch.nn.functional.normalize(torch.randn(m, generator=g), dim=0)
        v = v0 if shared == "in" else torch.nn.functional.normalize(torch.randn(n, generator=g), dim=0)
        noise = torch.randn(m, n, generator=g) / (m ** 0.5 + n ** 0.5)
        mats.append(noise + strength * torch.outer(u, v))
    return torch.stack(mats)  # (layers, m, n)


def gguf_name(key: str) -> str:
    """The GGUF name of an HF Llama tensor name (the inverse of flowgeom.nn.llama.GGUF_NAMES)."""
    from flowgeom.nn.llama import GGUF_NAMES

    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if key in top:
        return top[key]
    _, _, layer, *rest = key.split(".")  # model.layers.<l>.<module path>.weight
    names = {v: k for k, v in GGUF_NAMES.items()}
    return f"blk.{layer}.{names['.'.join(rest[:-1])]}.weight"


def write_gguf(path, tensors, *, quant=None, tokens: int = 0, kv=None) -> None:
    """A GGUF file with ``tensors`` (torch or numpy, order (out, in)); 2-D ones quantised to ``quant`` if given.

    ``tokens``: a vocabulary ``tok0 tok1 ...`` with scores; ``kv(writer)``: adds more metadata before the tensors.
    """
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    if tokens:
        w.add_token_list([f"tok{i}" for i in range(tokens)])
        w.add_token_scores([0.5] * tokens)
    if kv is not None:
        kv(w)
    for name, t in tensors.items():
        arr = np.asarray(t, dtype=np.float32)
        if quant is not None and arr.ndim == 2:
            w.add_tensor(name, gguf.quants.quantize(arr, quant), raw_dtype=quant)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
