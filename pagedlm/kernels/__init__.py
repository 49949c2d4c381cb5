"""pagedlm's native CPU kernels: C sources in ``pagedlm/csrc/``, built into one shared library
per process and loaded with ctypes by :mod:`pagedlm.kernels.loader`.

One module per op family holds each op's Python wrapper and its ctypes signature: ``attention``
(paged attention for decodes and prefill chunks), ``fused_ops`` (RMSNorm, SiLU-and-mul,
rotary, the KV-cache write), ``gemv`` (float32 linear layers), ``quant`` (quantized matmul),
``decode_stack`` (the fused decode stack's entry point); ``kv_types`` maps cache dtypes to the
kernels' codes. :func:`available` says whether the library can be used: it is False, after one
warning, when it cannot be built, and always with ``PAGEDLM_DISABLE_KERNELS=1``; every caller
then takes its PyTorch path.
"""
from pagedlm.kernels import attention, decode_stack, fused_ops, gemv, kv_types, quant
from pagedlm.kernels.loader import available, kernels_disabled

__all__ = ["attention", "available", "decode_stack", "fused_ops", "gemv", "kernels_disabled",
           "kv_types", "quant"]
