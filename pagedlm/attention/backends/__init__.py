"""Attention backends, and the choice of one (made once, when the model is built)."""
from __future__ import annotations

import torch

from pagedlm import envs
from pagedlm.attention.backends.abstract import AttentionBackend
from pagedlm.attention.backends.native import NativeKernelBackend
from pagedlm.attention.backends.torch_sdpa import TorchSDPABackend
from pagedlm.attention.backends.triton_attn import TritonAttentionBackend
from pagedlm.attention.metadata import AttentionMetadata

# In order of preference: the first that supports the dtype and device is used. Triton runs on
# a GPU (and on the CPU only when PAGEDLM_ATTENTION_BACKEND asks for it, in its interpreter).
_BACKENDS: tuple[type[AttentionBackend], ...] = (NativeKernelBackend, TritonAttentionBackend,
                                                 TorchSDPABackend)
# PAGEDLM_ATTENTION_BACKEND's values.
BACKENDS_BY_NAME: dict[str, type[AttentionBackend]] = {
    "native": NativeKernelBackend, "torch_sdpa": TorchSDPABackend,
    "triton": TritonAttentionBackend}
# What each backend needs, for the error when PAGEDLM_ATTENTION_BACKEND forces one that cannot
# run.
_NEEDS = {
    "native": "it takes float32 on the CPU, with the kernels built (a C compiler, no "
              "PAGEDLM_DISABLE_KERNELS).",
    "torch_sdpa": "it takes any dtype on any device.",
    "triton": "it takes float32, bfloat16 or float16 with Triton installed, on a GPU, or on "
              "the CPU in Triton's interpreter (TRITON_INTERPRET=1).",
}


def get_attn_backend(dtype: torch.dtype, device: torch.device | str = "cpu",
                     deterministic: bool = False) -> AttentionBackend:
    """The preferred backend for a model of this dtype on this device: Triton on a GPU, the
    native kernel for float32 on the CPU when it builds (and PAGEDLM_DISABLE_KERNELS is unset),
    else Torch SDPA. Building the kernel, on first use, happens here rather than inside the
    first request. PAGEDLM_ATTENTION_BACKEND ("native" | "torch_sdpa" | "triton") forces one,
    and is an error where that one cannot run.

    deterministic (ModelConfig.deterministic): the native kernel then computes every row the
    same way whatever the step holds; the other backends have no such mode, so it is refused
    there."""
    forced = envs.PAGEDLM_ATTENTION_BACKEND
    candidates = _BACKENDS
    if forced:
        if forced not in BACKENDS_BY_NAME:
            raise ValueError(f"PAGEDLM_ATTENTION_BACKEND={forced!r} is not a backend; expected "
                             f"one of {', '.join(BACKENDS_BY_NAME)} (or unset: automatic).")
        candidates = (BACKENDS_BY_NAME[forced],)
        if not candidates[0].supports(dtype, device):
            raise ValueError(f"PAGEDLM_ATTENTION_BACKEND={forced!r} cannot run {dtype} on "
                             f"{device} here: {_NEEDS[forced]}")
    for cls in candidates:
        if cls.supports(dtype, device):
            if cls is NativeKernelBackend:
                return NativeKernelBackend(deterministic=deterministic)
            if deterministic:
                raise ValueError(f"deterministic=True needs the native attention kernel, which "
                                 f"does not run here ({dtype} on {device}; it takes float32 "
                                 f"on the CPU, built, without PAGEDLM_DISABLE_KERNELS).")
            return cls()
    raise ValueError(f"no attention backend supports {dtype} on {device}")


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, backend: AttentionBackend | None = None,
                    sliding_window: int | None = None,
                    logits_soft_cap: float | None = None) -> torch.Tensor:
    """query [T, Hq, D], key/value [T, Hkv, D] -> [T, Hq, D], after writing K/V to the cache.

    A one-off call for tests and tools (models hold the backend chosen when they were built):
    runs `backend`, or the one get_attn_backend picks for the query's dtype and device now (so
    PAGEDLM_DISABLE_KERNELS=1 set before the call selects the PyTorch path).
    """
    if backend is None:
        backend = get_attn_backend(query.dtype, query.device)
    return backend.forward(query, key, value, k_cache, v_cache, meta, scale,
                           sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)


__all__ = ["AttentionBackend", "NativeKernelBackend", "TorchSDPABackend", "TritonAttentionBackend",
           "get_attn_backend", "paged_attention"]
