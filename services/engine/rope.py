"""Rotary position embedding with the scalings Llama-family checkpoints use.

Frequencies follow transformers' `modeling_rope_utils` (default, linear,
dynamic NTK, llama3); cos/sin are computed in float32 once for every position
up to the context limit and indexed by position at run time.

Dynamic NTK is applied statically, as vLLM does: the base is scaled once for a
fixed length, original max positions x factor, instead of per forward pass with
the current length (transformers). So the frequencies depend only on the
checkpoint, never on the engine's context limit or KV pool size. EngineSpec
turns the scaling off (plain RoPE, equal to transformers) unless the configured
context exceeds the original one.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from services.model.model_config import RopeScaling


def inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling, max_len: int) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], float32."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    kind = scaling.rope_type
    if kind == "dynamic":
        theta = dynamic_ntk_theta(head_dim, theta, scaling)
    inv_freq = 1.0 / (theta**exponents)
    if kind == "linear":
        return inv_freq / scaling.factor
    if kind == "llama3":
        return _llama3(inv_freq, scaling)
    return inv_freq


def dynamic_ntk_theta(head_dim: int, theta: float, scaling: RopeScaling) -> float:
    """The base vLLM's DynamicNTKScalingRotaryEmbedding uses: scaled for original x factor positions."""
    original = scaling.original_max_position_embeddings
    if original is None:
        raise ValueError("dynamic rope scaling needs original_max_position_embeddings")
    length = original * scaling.factor
    return theta * ((scaling.factor * length / original) - (scaling.factor - 1)) ** (
        head_dim / (head_dim - 2)
    )


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
    old_len = s.original_max_position_embeddings
    if old_len is None:
        raise ValueError("llama3 rope scaling needs original_max_position_embeddings")
    low_freq_wavelen = old_len / s.low_freq_factor
    high_freq_wavelen = old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling, max_len: int):
        super().__init__()
        inv_freq = inv_frequencies(head_dim, theta, scaling, max_len)
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)  # [L, D/2]
        cos, sin = freqs.cos(), freqs.sin()
        # Full-width tables, sin signed per half: x * cos + swap_halves(x) * sin is the rotation in
        # 4 ops (cat, 2 mul, add) instead of 7, with the same roundings (a - b == a + -b).
        self.register_buffer("cos", torch.cat((cos, cos), dim=-1), persistent=False)
        self.register_buffer("sin", torch.cat((-sin, sin), dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin [T, 1, D] for positions [T]; computed once per step, used by every layer."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D] rotated by halves (HF's rotate_half convention); cos, sin from
    RotaryEmbedding: (x1 * cos - x2 * sin, x2 * cos + x1 * sin)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((x2, x1), dim=-1) * sin
