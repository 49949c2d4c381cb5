"""Rotary position embedding (rotate-half layout, as in HF Llama), with llama3/linear scaling,
Phi-3's longrope, and partial rotation (only the first rotary_dim features of each head)."""
from __future__ import annotations

import math

import torch
from torch import nn

from pagedlm import kernels
from pagedlm.kernels.triton import fused_ops as triton_ops


def _inv_freq(head_dim: int, base: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        out = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        return torch.where(mid, blended, out)
    raise ValueError(f"rope_scaling type {kind!r} is not supported "
                     f"(default, linear, llama3, longrope).")


def _rope_kind(scaling: dict | None) -> str:
    return (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"


def _longrope_tables(rotary_dim: int, max_position: int, base: float, scaling: dict,
                     max_position_embeddings: int | None, max_model_len: int | None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for LongRoPE (Phi-3), computed as transformers computes them.

    Which factor set: transformers uses `short_factor` while a sequence's length is at most
    original_max_position_embeddings and `long_factor` beyond it, for every position of the
    sequence: Phi-3's generate() discards the KV cache when a sequence first crosses that
    length and re-encodes it all with the long factors. A paged cache shared between
    sequences (prefix caching) cannot hold a block in two rotations, so, as vLLM does, the set
    is fixed per engine: long when max_model_len exceeds the original length, short
    otherwise. That is exactly transformers' result for every sequence when max_model_len
    fits in the original length, and for every sequence longer than it otherwise; a shorter
    sequence under a longer max_model_len gets the long factors where transformers uses the
    short ones.

    Both sets are scaled by the attention factor: `attention_factor` if given, else
    sqrt(1 + ln(factor) / ln(original)) with factor = `factor` or max_position_embeddings /
    original (1.0 when factor <= 1)."""
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or (max_position_embeddings or original) / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = (1.0 if factor <= 1.0
                            else math.sqrt(1 + math.log(factor) / math.log(original)))
    key = "long_factor" if (max_model_len or max_position) > original else "short_factor"
    ext = torch.tensor(scaling[key], dtype=torch.float32)
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    if ext.shape != exponents.shape:
        raise ValueError(f"rope_scaling {key} has {ext.numel()} entries, expected "
                         f"{exponents.numel()} (rotary dimension / 2).")
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32),
                        1.0 / (ext * base ** exponents))
    return freqs.cos() * attention_factor, freqs.sin() * attention_factor


class RotaryEmbedding(nn.Module):

    def __init__(self, head_dim: int, max_position: int, base: float,
                 scaling: dict | None = None, rotary_dim: int | None = None,
                 max_position_embeddings: int | None = None,
                 max_model_len: int | None = None) -> None:
        """rotary_dim: the leading features of each head that are rotated (partial rotary
        embedding; the rest pass through), head_dim when None. max_position_embeddings (the
        config's) and max_model_len (the engine's): longrope needs them, for its default
        factor and to pick its factor set."""
        super().__init__()
        self.rotary_dim = rotary_dim or head_dim
        self.partial = self.rotary_dim != head_dim
        # Computed on the CPU even when the model is built on the meta device, and kept as
        # plain attributes (not buffers) so materialising the model leaves them alone.
        with torch.device("cpu"):
            # Tables looked up by position: one gather per step instead of trig per token.
            if _rope_kind(scaling) == "longrope":
                self.cos, self.sin = _longrope_tables(self.rotary_dim, max_position, base,
                                                      scaling, max_position_embeddings,
                                                      max_model_len)
            else:
                inv_freq = _inv_freq(self.rotary_dim, base, scaling)
                freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
                self.cos, self.sin = freqs.cos(), freqs.sin()
        self.cos, self.sin = self.cos.contiguous(), self.sin.contiguous()
        self.native = kernels.available()

    def _native_ok(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> bool:
        d = q.shape[-1]
        return (self.native and q.dtype is torch.float32 and k.dtype is torch.float32
                and positions.dtype is torch.int64 and positions.is_contiguous()
                and q.dim() == 3 and k.dim() == 3 and q.stride()[1:] == (d, 1)
                and k.stride()[1:] == (d, 1) and q.device.type == "cpu")

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; q [T, Hq, D]; k [T, Hkv, D]. float32 q and k are rotated in place
        (one native call for both, instead of about twenty dispatches) and returned; other
        dtypes get new tensors. Positions must be below the max_position it was built for."""
        if self._native_ok(positions, q, k):
            kernels.fused_ops.rotary_(positions, q, k, self.cos, self.sin)
            return q, k
        if self.cos.device != positions.device:
            # The tables are built on the CPU (see __init__); a GPU model moves them on its
            # first step (a warm-up step, before any CUDA graph is captured).
            self.cos, self.sin = self.cos.to(positions.device), self.sin.to(positions.device)
        if (q.is_cuda and q.dim() == 3 and k.dim() == 3 and q.stride(2) == 1
                and k.stride(2) == 1):
            # One Triton launch for q and k instead of about twenty, in place like the native
            # kernel.
            triton_ops.rotary_(positions, q, k, self.cos, self.sin)
            return q, k
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        if self.partial:
            return _rotate_partial(q, cos, sin), _rotate_partial(k, cos, sin)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)


def _rotate_partial(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rotary_dim = 2 * cos.shape[-1]
    return torch.cat((_rotate(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)
