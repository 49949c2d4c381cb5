"""pagedlm's GPU kernels, in Triton: one module per op family, each importing Triton only when
its kernels are first used (CPU-only installs need not have it). The `*_jit` modules hold the
`@triton.jit` functions at module level, where Triton's compiler and interpreter read `tl`.

Without a GPU they run on CPU tensors under TRITON_INTERPRET=1 (the tests do this), which must be
set before triton is first imported.
"""
