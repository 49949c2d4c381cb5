"""The fused decode stack's entry point (csrc/llama_decode.c): a pipeline stage's decoder layers
for one decode step in one call. Its driver, which fills the layer structs and decides which
steps it runs, is model_executor/layers/fused_decode.py."""
from __future__ import annotations

import ctypes

from pagedlm.kernels.loader import typed_library

_p, _i = ctypes.c_void_p, ctypes.c_int
# llama_decode_f32(dims, layers, x, residual, has_residual, M, positions, slots, block_tables,
#                  max_blocks, ctx_lens, nthreads) -> 0, or -1 without scratch memory.
library = typed_library({
    "llama_decode_f32": ([_p, _p, _p, _p, _i, _i, _p, _p, _p, _i, _p, _i], _i),
})
