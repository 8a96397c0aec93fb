"""Rotary position embeddings (RoPE), including Llama-3 and linear frequency scaling.

The frequencies and the cos/sin tables are computed in float32 whatever the model dtype: rounding
them to bfloat16 moves the angle of late positions by whole radians. The tables are cast to the
model dtype only when applied, as HF transformers does, so float32 runs match it exactly.
"""

from __future__ import annotations

import math

import torch

from verispec.models.config import ModelConfig
from verispec.ops.model_ops import apply_rope  # noqa: F401 - the models' import of it


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """[head_dim // 2] float32: theta_i = base^(-2i / head_dim), rescaled per ``rope_scaling``."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if config.rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif config.rope_type == "llama3":
        # Llama 3.1: wavelengths longer than the original context / low_freq_factor are slowed down
        # by `factor`; shorter than original / high_freq_factor kept; in between interpolated.
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_context = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_context / high) * ~(wavelen > old_context / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


def rope_tables(config: ModelConfig, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin for positions ``0 .. max_len - 1``: two [max_len, head_dim] float32
    tables.

    Row p of cos is ``cos(p * theta)`` over both halves (the rotate-half layout of HF Llama); row
    p of the signed sin is ``[-sin(p * theta), sin(p * theta)]``, the sign of ``rotate_half``
    folded in (see ``apply_rope``).
    """
    inv_freq = inverse_frequencies(config)
    positions = torch.arange(max_len, dtype=torch.float32)
    angles = positions[:, None] * inv_freq[None, :]  # [max_len, head_dim // 2]
    emb = torch.cat((angles, angles), dim=-1)
    sin = emb.sin()
    half = sin.shape[-1] // 2
    sin[:, :half].neg_()
    return emb.cos(), sin



