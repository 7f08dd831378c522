"""Rotary position embedding (RoPE) whose bits depend only on a token's absolute position.

cos/sin come from a table indexed by position. Computing cos(pos * inv_freq) per call would
make a token's angle pass through a vectorised body or a scalar tail depending on how many
tokens share the call, and those can round differently (measured on CPU for torch's silu and
sigmoid). The table is filled in chunks of a fixed shape, so a position's entry is the same
whenever and however the table grows; a gather reads it exactly. The rotation itself is fp32
multiplies and adds, each correctly rounded. The math is transformers' Llama RoPE (rotate-half
layout; the "llama3" frequency scaling of Llama 3.1/3.2).
"""

from __future__ import annotations

import math

import torch

from bik.dvr.config import LlamaConfig

__all__ = ["RopeTable", "apply_rope", "inverse_frequencies"]

TABLE_CHUNK = 1024  # positions per table chunk: every chunk is computed with this shape


def inverse_frequencies(config: LlamaConfig) -> torch.Tensor:
    """fp32 [head_dim / 2] inverse frequencies, with llama3 scaling if the config has it.

    Computed on the CPU with the same sequence of fp32 ops as transformers, so the angles agree.
    """
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (config.rope_theta ** exponents)
    s = config.rope_scaling
    if s is None:
        return inv_freq
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed down by `factor`, short ones kept, the band between them
    # interpolated linearly in 1/wavelength.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


class RopeTable:
    """cos/sin [positions, head_dim / 2] in fp32 on one device, grown on demand."""

    def __init__(self, config: LlamaConfig, device: torch.device | str):
        self.inv_freq = inverse_frequencies(config).to(device)
        self.device = torch.device(device)
        half = config.head_dim // 2
        self.cos = torch.empty((0, half), dtype=torch.float32, device=device)
        self.sin = torch.empty((0, half), dtype=torch.float32, device=device)

    def ensure(self, num_positions: int) -> None:
        """Make positions 0 .. num_positions - 1 available (no-op when they already are)."""
        have = self.cos.shape[0]
        if num_positions <= have:
            return
        chunks = range(have, num_positions, TABLE_CHUNK)
        cos, sin = [self.cos], [self.sin]
        for start in chunks:
            pos = torch.arange(start, start + TABLE_CHUNK, dtype=torch.float32,
                               device=self.device)
            angles = pos[:, None] * self.inv_freq[None, :]  # fp32 product, as transformers
            cos.append(angles.cos())
            sin.append(angles.sin())
        self.cos, self.sin = torch.cat(cos), torch.cat(sin)

    def lookup(self, positions: torch.Tensor, num_positions: int):
        """(cos, sin) rows for ``positions`` [T]; all positions must be < num_positions."""
        self.ensure(num_positions)
        return self.cos[positions], self.sin[positions]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] by the angles of its token ([T, D/2] cos and sin), in fp32.

    Rotate-half layout: the pairs are (x[i], x[i + D/2]). Returns x's dtype.
    """
    half = x.shape[-1] // 2
    x32 = x.float()
    x1, x2 = x32[..., :half], x32[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    # x1*c - x2*s has the bits of transformers' x1*c + (-x2)*s (negation is exact).
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
