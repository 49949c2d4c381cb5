"""Linear layers whose weights are stacked from several checkpoint tensors.

Q, K and V (and gate and up) run as one matmul; the loader copies each checkpoint tensor into
its shard of the stacked weight.
"""
from __future__ import annotations

import torch
from torch import nn


class StackedLinear(nn.Module):
    """y = x @ [W_0; W_1; ...]^T (+ b): shards named in order, each with its output size."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool = False) -> None:
        super().__init__()
        self.shard_sizes = shard_sizes
        out = sum(shard_sizes.values())
        self.weight = nn.Parameter(torch.empty(out, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out), requires_grad=False) if bias else None

    def shard_slice(self, shard: str) -> slice:
        start = 0
        for name, size in self.shard_sizes.items():
            if name == shard:
                return slice(start, start + size)
            start += size
        raise KeyError(shard)

    def load_shard(self, param_name: str, shard: str, tensor: torch.Tensor) -> None:
        getattr(self, param_name).data[self.shard_slice(shard)].copy_(tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)
