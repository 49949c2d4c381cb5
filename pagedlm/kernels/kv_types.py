"""The KV-cache element types the kernels read and write (csrc/include/kv_types.h's enum)."""
from __future__ import annotations

import torch

# torch dtype -> the kernels' kv_type code.
KV_TYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# The cache dtypes the kernels take (config.KV_CACHE_DTYPES names the --kv-cache-dtype choices).
KERNEL_KV_DTYPES = tuple(KV_TYPE_CODES)
