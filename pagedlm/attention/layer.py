"""The Attention layer a model calls: paged attention through the backend chosen at build."""
from __future__ import annotations

import torch
from torch import nn

from pagedlm.attention.backends import AttentionBackend, get_attn_backend
from pagedlm.attention.metadata import AttentionMetadata


class Attention(nn.Module):
    """Multi-head (grouped-query) paged attention over this rank's heads.

    num_heads / num_kv_heads are the heads this layer computes (per tensor-parallel rank). The
    backend is chosen once, here or by the model (so all layers share one), never per call.
    sliding_window (keys a query sees, itself included) and logits_soft_cap are this layer's:
    a model may mix local and global layers.
    """

    def __init__(self, num_heads: int, head_dim: int, scale: float,
                 num_kv_heads: int | None = None, backend: AttentionBackend | None = None,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None
                 ) -> None:
        super().__init__()
        if sliding_window is not None and (not isinstance(sliding_window, int)
                                           or isinstance(sliding_window, bool)
                                           or sliding_window < 1):
            raise ValueError(f"sliding_window must be a positive integer or None, got "
                             f"{sliding_window!r}.")
        if logits_soft_cap is not None and not logits_soft_cap > 0:
            raise ValueError(f"logits_soft_cap must be positive or None, got "
                             f"{logits_soft_cap!r}.")
        self.sliding_window = sliding_window
        self.logits_soft_cap = None if logits_soft_cap is None else float(logits_soft_cap)
        self.num_heads, self.head_dim, self.scale = num_heads, head_dim, scale
        self.num_kv_heads = num_kv_heads or num_heads
        assert self.num_heads % self.num_kv_heads == 0, (
            f"{num_heads} query heads are not a multiple of {self.num_kv_heads} KV heads")
        self.backend = backend or get_attn_backend(torch.get_default_dtype())

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor],
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """query [T, Hq(*D)], key/value [T, Hkv(*D)] -> [T, Hq * D]; writes K/V to kv_cache,
        this layer's (key, value) blocks [num_blocks, block_size, Hkv, D]."""
        n = query.shape[0]
        out = self.backend.forward(query.reshape(n, self.num_heads, self.head_dim),
                                   key.reshape(n, self.num_kv_heads, self.head_dim),
                                   value.reshape(n, self.num_kv_heads, self.head_dim),
                                   kv_cache[0], kv_cache[1], attn_metadata, self.scale,
                                   self.sliding_window, self.logits_soft_cap)
        return out.view(n, self.num_heads * self.head_dim)

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, sliding_window={self.sliding_window}, "
                f"logits_soft_cap={self.logits_soft_cap}, backend={self.backend.name}")
