"""Building blocks of the decoder models, written to mirror transformers' numerics."""

from pagoda.layers.activation import SiluAndMul, get_act_fn
from pagoda.layers.attention import Attention
from pagoda.layers.linear import Embedding, Linear, MergedLinear
from pagoda.layers.norm import RMSNorm
from pagoda.layers.rotary import RotaryEmbedding, apply_rotary, apply_rotary_qk, compute_inv_freq

__all__ = [
    "Attention",
    "Embedding",
    "Linear",
    "MergedLinear",
    "RMSNorm",
    "RotaryEmbedding",
    "SiluAndMul",
    "apply_rotary",
    "apply_rotary_qk",
    "compute_inv_freq",
    "get_act_fn",
]
