"""Attention backends, and the choice of one (made once, when the model is built)."""
from __future__ import annotations

import torch

from pagedlm.attention.backends.abstract import AttentionBackend
from pagedlm.attention.backends.native import NativeKernelBackend
from pagedlm.attention.backends.torch_sdpa import TorchSDPABackend

# In order of preference: the first that supports the dtype and device is used.
_BACKENDS: tuple[type[AttentionBackend], ...] = (NativeKernelBackend, TorchSDPABackend)


def get_attn_backend(dtype: torch.dtype, device: torch.device | str = "cpu") -> AttentionBackend:
    """The preferred backend for a model of this dtype on this device: the native kernel for
    float32 on the CPU when it builds (and PAGEDLM_DISABLE_KERNELS is unset), else Torch SDPA.
    Building the kernel, on first use, happens here rather than inside the first request."""
    for cls in _BACKENDS:
        if cls.supports(dtype, device):
            return cls()
    raise ValueError(f"no attention backend supports {dtype} on {device}")


__all__ = ["AttentionBackend", "NativeKernelBackend", "TorchSDPABackend", "get_attn_backend"]
