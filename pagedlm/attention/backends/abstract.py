"""The attention-backend interface: one object computes paged attention for a whole model."""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from pagedlm.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    """Writes the step's K/V into the paged cache and attends (see attention/metadata.py for the
    batch and cache layout). Stateless across steps: anything it precomputes per step lives on
    the AttentionMetadata, which the layers of one step share."""

    name: str

    @classmethod
    @abstractmethod
    def supports(cls, dtype: torch.dtype, device: torch.device | str) -> bool:
        """Whether this backend can run a model of this dtype on this device here."""

    @abstractmethod
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, sliding_window: int | None = None,
                logits_soft_cap: float | None = None) -> torch.Tensor:
        """query [T, Hq, D], key/value [T, Hkv, D] -> [T, Hq, D].

        sliding_window: a query at position p sees only the keys at positions p - window + 1
        .. p (transformers' convention). logits_soft_cap c: scores (already scaled) become
        c * tanh(score / c) before the softmax. Both are per layer, hence per call."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
