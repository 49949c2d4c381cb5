"""The CacheEngine owns the paged KV cache tensors and copies blocks within and between them.

The device pool is what attention reads; the host pool holds swapped-out blocks. On a CPU both
are host memory, but the copies are the same ones a GPU engine makes over PCIe. On CUDA the
device pool is GPU memory and the host pool is pinned (page-locked) host memory, which the
GPU's copy engines read and write directly.
"""
from __future__ import annotations

import torch

from pagedlm import huge_pages
from pagedlm.config import CacheConfig, ModelConfig

KVCache = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (key, value) blocks


def kv_bytes_per_block(model_config: ModelConfig, block_size: int,
                       num_kv_heads: int | None = None, num_layers: int | None = None,
                       dtype: torch.dtype | None = None) -> int:
    """Bytes of one block over all layers. On a parallel rank pass its own KV heads
    (model_config.get_num_kv_heads(tp)) and layer count (model_config.get_num_layers(pp, rank));
    the defaults are the whole model's. dtype: the cache's (default the model's)."""
    elem = torch.tensor([], dtype=dtype or model_config.dtype).element_size()
    num_kv_heads = num_kv_heads or model_config.num_kv_heads
    num_layers = num_layers or model_config.num_layers
    return 2 * num_layers * block_size * num_kv_heads * model_config.head_dim * elem


def _allocate(num_blocks: int, model_config: ModelConfig, block_size: int,
              num_kv_heads: int | None = None, num_layers: int | None = None,
              dtype: torch.dtype | None = None, commit: bool = False,
              device: torch.device | str = "cpu", pin_memory: bool = False,
              huge: bool = False) -> KVCache:
    """Per layer (of this rank's stage: index i is its i-th layer) a (key, value) pair of
    [num_blocks, block_size, num_kv_heads, head_dim]; defaults as in kv_bytes_per_block.

    commit: fault every page in now. Otherwise the pages are faulted in by the first write to
    each block, and on this VM a first touch costs about 11 us per 4 KiB page (the host backs
    the guest's memory lazily; transparent huge pages cost the same per byte): the 128-request
    benchmark took 578k faults and 5-6.5 s of its 64-70 s in the cache write, 0 faults and
    0.3 s once the blocks had been used. Committing the default size (90% of free RAM, about
    19 GiB here) took 7-45 s, too much for every LLM(); an explicit size is committed.
    Attention never reads unwritten slots unmasked, so the contents do not matter; on CUDA
    the pool is zeroed all the same (at the GPU's bandwidth, a few ms), so that a padded read
    never meets a NaN bit pattern.

    huge: on the CPU, each layer's large key and value tensors go on 2 MiB huge pages
    (huge_pages.py: decode attention reads the blocks scattered, and 4 KiB pages made
    it 1.27x slower). The swap pool does not ask: it is written a block at a time, and a
    huge page would fault in 2 MiB for each."""
    num_kv_heads = num_kv_heads or model_config.num_kv_heads
    num_layers = num_layers or model_config.num_layers
    shape = (num_blocks, block_size, num_kv_heads, model_config.head_dim)
    dtype = dtype or model_config.dtype
    device = torch.device(device)
    if huge and device.type == "cpu" and not pin_memory:
        return [(huge_pages.empty(shape, dtype, zero=commit),
                 huge_pages.empty(shape, dtype, zero=commit)) for _ in range(num_layers)]
    make = torch.zeros if commit or device.type == "cuda" else torch.empty
    kwargs = dict(dtype=dtype, device=device, pin_memory=pin_memory)
    return [(make(shape, **kwargs), make(shape, **kwargs)) for _ in range(num_layers)]


def _copy(src: KVCache, dst: KVCache, pairs: list[tuple[int, int]]) -> None:
    """Blocks src[i] -> dst[j] for each (i, j): gathered where src lives, moved once per
    layer, scattered where dst lives (each side's index tensor on its own device)."""
    if not pairs or not src:
        return
    src_dev, dst_dev = src[0][0].device, dst[0][0].device
    src_ids = torch.tensor([p[0] for p in pairs], device=src_dev)
    dst_ids = torch.tensor([p[1] for p in pairs], device=dst_dev)
    for (src_k, src_v), (dst_k, dst_v) in zip(src, dst):
        dst_k.index_copy_(0, dst_ids, src_k.index_select(0, src_ids).to(dst_dev))
        dst_v.index_copy_(0, dst_ids, src_v.index_select(0, src_ids).to(dst_dev))


class CacheEngine:

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig,
                 num_gpu_blocks: int, num_cpu_blocks: int = 0,
                 num_kv_heads: int | None = None, num_layers: int | None = None,
                 device: torch.device | str = "cpu") -> None:
        """num_kv_heads / num_layers: this rank's (see kv_bytes_per_block); default the model's.
        device: the worker's (the device pool's; the host pool is pinned when it is CUDA)."""
        dtype = cache_config.kv_dtype(model_config.dtype)
        device = torch.device(device)
        self.kv_caches = _allocate(num_gpu_blocks, model_config, cache_config.block_size,
                                   num_kv_heads, num_layers, dtype,
                                   commit=cache_config.reserves_memory, device=device,
                                   huge=True)
        self.host_kv_caches = _allocate(num_cpu_blocks, model_config, cache_config.block_size,
                                        num_kv_heads, num_layers, dtype,
                                        pin_memory=device.type == "cuda" and num_cpu_blocks > 0)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        _copy(self.kv_caches, self.host_kv_caches, pairs)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        _copy(self.host_kv_caches, self.kv_caches, pairs)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        _copy(self.kv_caches, self.kv_caches, pairs)
