"""The architecture zoo: short names, typed size configs, builders.

Every architecture has a frozen config dataclass (fields = CLI size options,
validated in ``__post_init__``) and builds a module that can draw its own
valid input with ``sample_input(batch, generator)``.

>>> from flowgeom.nn import build
>>> build("mha", heads=2, d_k=4, positions="rope").q_proj.weight.shape
torch.Size([8, 8])
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from flowgeom.errors import FlowgeomError, choice_error, positive_int
from flowgeom.nn.attention import POSITIONS, MultiHeadAttention
from flowgeom.nn.feedforward import ACTIVATIONS, FeedForward, LinearChain, SwiGLU
from flowgeom.nn.moe import GATES, MixtureOfExperts


def _opt(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices})


def _positive(cfg: object, *names: str) -> None:
    for name in names:
        if getattr(cfg, name) is not None:
            positive_int(getattr(cfg, name), "--" + name.replace("_", "-"))


def _one_of(cfg: object, name: str, options: tuple[str, ...]) -> None:
    if getattr(cfg, name) not in options:
        raise choice_error(name.replace("_", "-"), getattr(cfg, name), options)


@dataclass(frozen=True)
class FFNConfig:
    d_model: int = _opt(6, "input width")
    d_hidden: int = _opt(8, "hidden width")
    d_out: int | None = _opt(None, "output width (default d_model)")
    activation: str = _opt("gelu", "activation", tuple(ACTIVATIONS))
    bias: bool = _opt(False, "biases on both layers")

    def __post_init__(self):
        _positive(self, "d_model", "d_hidden", "d_out")
        _one_of(self, "activation", tuple(ACTIVATIONS))

    def build(self) -> nn.Module:
        return FeedForward(self.d_model, self.d_hidden, self.d_out, activation=self.activation, bias=self.bias)


@dataclass(frozen=True)
class SwiGLUConfig:
    d_model: int = _opt(6, "input width")
    d_hidden: int = _opt(8, "hidden width m")
    d_out: int | None = _opt(None, "output width (default d_model)")

    def __post_init__(self):
        _positive(self, "d_model", "d_hidden", "d_out")

    def build(self) -> nn.Module:
        return SwiGLU(self.d_model, self.d_hidden, self.d_out)


@dataclass(frozen=True)
class MHAConfig:
    d_model: int = _opt(6, "model width")
    heads: int = _opt(2, "number of heads H")
    d_k: int = _opt(2, "query/key head dim")
    d_v: int = _opt(3, "value head dim")
    positions: str = _opt("none", "positional encoding", POSITIONS)
    seq_len: int = _opt(4, "sequence length of sampled inputs")

    def __post_init__(self):
        _positive(self, "d_model", "heads", "d_k", "d_v", "seq_len")
        _one_of(self, "positions", POSITIONS)
        if self.positions == "rope" and self.d_k % 2:
            raise FlowgeomError(f"RoPE needs an even head dim, got --d-k {self.d_k}; pass an even --d-k")

    def build(self) -> nn.Module:
        return MultiHeadAttention(self.d_model, self.heads, self.d_k, self.d_v, positions=self.positions, seq_len=self.seq_len)


@dataclass(frozen=True)
class MoEConfig:
    d_model: int = _opt(4, "model width")
    d_hidden: int = _opt(3, "hidden width m of each SwiGLU expert")
    experts: int = _opt(3, "number of experts E")
    gate: str = _opt("softmax", "router gate (sigmoid = normalised sigmoid)", GATES)
    top_k: int | None = _opt(None, "route to the top-k experts (default: dense)")
    router_bias: bool = _opt(False, "bias on the router")

    def __post_init__(self):
        _positive(self, "d_model", "d_hidden", "experts", "top_k")
        _one_of(self, "gate", GATES)
        if self.top_k is not None and self.top_k > self.experts:
            raise FlowgeomError(f"--top-k {self.top_k} exceeds --experts {self.experts}; choose top-k <= experts")

    def build(self) -> nn.Module:
        return MixtureOfExperts(self.d_model, self.d_hidden, self.experts, gate=self.gate, top_k=self.top_k,
                                router_bias=self.router_bias)


@dataclass(frozen=True)
class TwoLayerConfig:
    """Marcotte et al.'s two-layer nets f(x) = U sigma(V x), V (r d_in), U (d_out r)."""

    d_in: int = _opt(4, "input width")
    width: int = _opt(3, "inner width r")
    d_out: int = _opt(5, "output width")
    bias: bool = _opt(False, "biases on both layers")

    def __post_init__(self):
        _positive(self, "d_in", "width", "d_out")


@dataclass(frozen=True)
class Linear2Config(TwoLayerConfig):
    def build(self) -> nn.Module:
        return FeedForward(self.d_in, self.width, self.d_out, activation="identity", bias=self.bias)


@dataclass(frozen=True)
class ReLU2Config(TwoLayerConfig):
    def build(self) -> nn.Module:
        return FeedForward(self.d_in, self.width, self.d_out, activation="relu", bias=self.bias)


@dataclass(frozen=True)
class ChainConfig:
    widths: str = _opt("4,3,3,5", "comma-separated widths d_0,...,d_L of a deep linear chain")

    def __post_init__(self):
        try:
            ws = tuple(int(w) for w in str(self.widths).split(","))
        except ValueError:
            raise FlowgeomError(f"--widths must be comma-separated integers, got {self.widths!r}") from None
        if len(ws) < 2 or min(ws) < 1:
            raise FlowgeomError(f"--widths needs at least two positive widths, got {self.widths!r}")

    def build(self) -> nn.Module:
        return LinearChain(tuple(int(w) for w in self.widths.split(",")))


ARCHITECTURES: dict[str, tuple[type, str]] = {
    "ffn": (FFNConfig, "two-layer feed-forward down(act(up x))"),
    "swiglu": (SwiGLUConfig, "Llama MLP down(silu(gate x) * up x)"),
    "mha": (MHAConfig, "multi-head self-attention, positions none/sinusoidal/rope"),
    "moe": (MoEConfig, "mixture of SwiGLU experts, softmax or normalised-sigmoid router"),
    "linear2": (Linear2Config, "two-layer linear net U V x (Marcotte et al.)"),
    "relu2": (ReLU2Config, "two-layer ReLU net U relu(V x) (Marcotte et al.)"),
    "chain": (ChainConfig, "deep linear chain W_L ... W_1 x"),
}


def config(name: str, **options: Any) -> Any:
    """The validated config of architecture ``name`` with ``options``."""
    if name not in ARCHITECTURES:
        raise choice_error("architecture", name, ARCHITECTURES)
    cls = ARCHITECTURES[name][0]
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - known)
    if unknown:
        flags = ", ".join("--" + u.replace("_", "-") for u in unknown)
        valid = ", ".join("--" + k.replace("_", "-") for k in sorted(known))
        raise FlowgeomError(f"{flags} does not apply to {name}; its size options are: {valid}")
    return cls(**options)


def build(name: str, *, seed: int | None = None, **options: Any) -> nn.Module:
    """Build architecture ``name``; ``seed`` fixes the initial weights."""
    import torch

    cfg = config(name, **options)
    if seed is None:
        module = cfg.build()
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            module = cfg.build()
    return module


def option_fields() -> dict[str, dataclasses.Field]:
    """Every size option across the zoo (same name = same meaning), for the CLI."""
    out: dict[str, dataclasses.Field] = {}
    for cls, _ in ARCHITECTURES.values():
        for f in dataclasses.fields(cls):
            out.setdefault(f.name, f)
    return out
