"""The CacheEngine owns the paged KV cache tensors and copies blocks within and between them.

The device pool is what attention reads; the host pool holds swapped-out blocks. On a CPU both
are host memory, but the copies are the same ones a GPU engine makes over PCIe.
"""
from __future__ import annotations

import torch

from pagedlm.config import CacheConfig, ModelConfig

KVCache = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (key, value) blocks


def kv_bytes_per_block(model_config: ModelConfig, block_size: int) -> int:
    elem = torch.tensor([], dtype=model_config.dtype).element_size()
    return (2 * model_config.num_layers * block_size * model_config.num_kv_heads
            * model_config.head_dim * elem)


def _allocate(num_blocks: int, model_config: ModelConfig, block_size: int) -> KVCache:
    shape = (num_blocks, block_size, model_config.num_kv_heads, model_config.head_dim)
    # Empty, not zeroed: pages are only faulted in when a block is first written, so a large
    # cache costs nothing up front. Attention never uses unwritten slots unmasked.
    return [(torch.empty(shape, dtype=model_config.dtype),
             torch.empty(shape, dtype=model_config.dtype))
            for _ in range(model_config.num_layers)]


def _copy(src: KVCache, dst: KVCache, pairs: list[tuple[int, int]]) -> None:
    if not pairs:
        return
    src_ids = torch.tensor([p[0] for p in pairs])
    dst_ids = torch.tensor([p[1] for p in pairs])
    for (src_k, src_v), (dst_k, dst_v) in zip(src, dst):
        dst_k[dst_ids] = src_k[src_ids]
        dst_v[dst_ids] = src_v[src_ids]


class CacheEngine:

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig) -> None:
        self.kv_caches = _allocate(cache_config.num_gpu_blocks, model_config,
                                   cache_config.block_size)
        self.host_kv_caches = _allocate(cache_config.num_cpu_blocks, model_config,
                                        cache_config.block_size)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        _copy(self.kv_caches, self.host_kv_caches, pairs)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        _copy(self.host_kv_caches, self.kv_caches, pairs)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        _copy(self.kv_caches, self.kv_caches, pairs)
