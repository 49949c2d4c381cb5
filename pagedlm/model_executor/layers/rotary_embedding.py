"""Rotary position embedding (rotate-half layout, as in HF Llama), with llama3/linear scaling."""
from __future__ import annotations

import math

import torch
from torch import nn


def _inv_freq(head_dim: int, base: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        out = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        return torch.where(mid, blended, out)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (default, linear, llama3).")


class RotaryEmbedding(nn.Module):

    def __init__(self, head_dim: int, max_position: int, base: float,
                 scaling: dict | None = None) -> None:
        super().__init__()
        # Computed on the CPU even when the model is built on the meta device, and kept as
        # plain attributes (not buffers) so materialising the model leaves them alone.
        with torch.device("cpu"):
            inv_freq = _inv_freq(head_dim, base, scaling)
            freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
            # Tables looked up by position: one gather per step instead of trig per token.
            self.cos, self.sin = freqs.cos(), freqs.sin()

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; q [T, Hq, D]; k [T, Hkv, D]."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)
