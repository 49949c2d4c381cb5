"""Linear layers. Weights are pre-packed for oneDNN after loading; QKV and gate/up run stacked.

Why oneDNN: on this class of CPU (AMD EPYC, AVX-512), torch's default fp32 GEMM (MKL) reaches
60-140 GFLOPS on the decode and prefill shapes of a small model, while oneDNN with a pre-packed
weight reaches 160-190 (measured here; see the closing notes of the core-engine issue). The
packed tensor is opaque, so the plain weight is kept for loading and inspection.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from pagedlm.utils import env_flag

logger = logging.getLogger(__name__)


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight in oneDNN's blocked layout, or None where that is unavailable or disabled."""
    if (env_flag("PAGEDLM_DISABLE_ONEDNN") or weight.device.type != "cpu"
            or weight.dtype not in (torch.float32, torch.bfloat16)
            or not torch.backends.mkldnn.is_available()):
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_size=None)
        # A private op: check it agrees with F.linear once before trusting it.
        probe = torch.ones(1, weight.shape[1], dtype=weight.dtype)
        got = torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
        if not torch.allclose(got.float(), F.linear(probe, weight).float(), rtol=1e-2, atol=1e-2):
            raise RuntimeError("packed weight disagrees with F.linear")
        return packed
    except (RuntimeError, AttributeError) as e:
        logger.warning("oneDNN weight packing unavailable, using F.linear: %s", e)
        return None


class Linear(nn.Module):
    """y = x W^T + b over a flat batch x [num_tokens, in_features]."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.packed_weight: torch.Tensor | None = None

    def process_weights_after_loading(self) -> None:
        self.packed_weight = pack_weight(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none",
                                                      [], "")
        return F.linear(x, self.weight, self.bias)


class StackedLinear(Linear):
    """One matmul for several checkpoint tensors ([W_q; W_k; W_v] or [W_gate; W_up]); the
    loader copies each tensor into its shard."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias)
        self.shard_sizes = shard_sizes

    def shard_slice(self, shard: str) -> slice:
        start = 0
        for name, size in self.shard_sizes.items():
            if name == shard:
                return slice(start, start + size)
            start += size
        raise KeyError(shard)

    def load_shard(self, param_name: str, shard: str, tensor: torch.Tensor) -> None:
        getattr(self, param_name).data[self.shard_slice(shard)].copy_(tensor)
