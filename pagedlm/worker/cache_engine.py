"""The CacheEngine owns the paged KV cache tensors and copies blocks between them."""
from __future__ import annotations

import torch

from pagedlm.config import CacheConfig, ModelConfig


def kv_bytes_per_block(model_config: ModelConfig, block_size: int) -> int:
    elem = torch.tensor([], dtype=model_config.dtype).element_size()
    return (2 * model_config.num_layers * block_size * model_config.num_kv_heads
            * model_config.head_dim * elem)


class CacheEngine:

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig) -> None:
        shape = (cache_config.num_gpu_blocks, cache_config.block_size, model_config.num_kv_heads,
                 model_config.head_dim)
        # Empty, not zeroed: pages are only faulted in when a block is first written, so a
        # large cache costs nothing up front. Attention never uses unwritten slots unmasked.
        self.kv_caches = [(torch.empty(shape, dtype=model_config.dtype),
                           torch.empty(shape, dtype=model_config.dtype))
                          for _ in range(model_config.num_layers)]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs])
        dst = torch.tensor([p[1] for p in pairs])
        for k_cache, v_cache in self.kv_caches:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]
