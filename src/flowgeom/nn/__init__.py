"""Architecture zoo: plain PyTorch modules with HF-Llama parameter names."""

from flowgeom.nn.attention import MultiHeadAttention
from flowgeom.nn.block import PreNormBlock
from flowgeom.nn.feedforward import FeedForward, LinearChain, SwiGLU
from flowgeom.nn.moe import MixtureOfExperts
from flowgeom.nn.zoo import ARCHITECTURES, build, config

__all__ = ["ARCHITECTURES", "FeedForward", "LinearChain", "MixtureOfExperts", "MultiHeadAttention", "PreNormBlock", "SwiGLU", "build", "config"]
