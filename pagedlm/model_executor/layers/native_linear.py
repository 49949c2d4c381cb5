"""A linear layer's weight as pagedlm's native kernels read it (`LinearMethodBase.native_form`):
the format a kernel multiplies by and the tensors it reads, which the fused decode stack
(fused_decode.py) hands to C and which says whether a caller may run that kernel on any number
of rows."""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class WeightFormat(enum.IntEnum):
    """A weight layout one of the native matmul kernels multiplies by; the values are the
    fused decode stack's (llama_decode.c's weight formats)."""
    FLOAT = 0  # float32 [out, in], gemv_f32
    Q4_1 = 1  # quantization/kernels.py's formats, qmm_<format>
    Q8_0 = 2
    I8 = 3  # with a float32 scale per output row
    FLOAT_PANELS = 4  # float32 panels of gemv.pack_panels, gemm_panels_f32
    BF16_PANELS = 5  # bfloat16 panels of gemv.pack_panels, gemm_panels_bf16 (float32 math)
    Q4_K = 6  # ggml's blocks as stored (kernels.py), qmm_<format> of csrc/quant_kquants.c
    Q5_K = 7
    Q6_K = 8
    Q3_K = 9
    Q2_K = 10
    Q5_0 = 11
    Q5_1 = 12
    IQ4_NL = 13
    F16_PANELS = 14  # float16 panels of gemv.pack_panels, gemm_panels_f16 (float32 math)


# The panel format of each element type gemv.pack_panels packs.
PANEL_FORMATS = {torch.float32: WeightFormat.FLOAT_PANELS,
                 torch.bfloat16: WeightFormat.BF16_PANELS,
                 torch.float16: WeightFormat.F16_PANELS}


@dataclass(frozen=True)
class NativeLinear:
    """A linear layer's weight as a native kernel reads it: `apply` at decode batch sizes
    computes what that kernel computes on these tensors (the layer's bias comes on top)."""
    fmt: WeightFormat
    weight: torch.Tensor
    scale: torch.Tensor | None = None  # WeightFormat.I8's per-row scales
    # `apply` runs this kernel at every row count (deterministic=True), not only at decode
    # batch sizes; panel weights do, but bfloat16 ones where `apply` takes many rows to AMX.
    every_row_count: bool = False
    # From this many rows `apply` runs another kernel on the same panels (AMX_MIN_ROWS where
    # bfloat16 panels go to AMX, DPBF16_MIN_ROWS where they go to vdpbf16ps); 0: never.
    other_kernel_from: int = 0
    # The kernel takes x in two 8-bit limbs (a quantized format's qmm16_<fmt>, under
    # PAGEDLM_PRECISE_ACTIVATIONS), not at 8 bits.
    two_limbs: bool = False

    @property
    def batch_invariant(self) -> bool:
        """Whether `apply` runs this kernel whatever the row count: a caller may then run it
        on any number of rows and still compute what `apply` does."""
        return self.every_row_count or (self.fmt in PANEL_FORMATS.values()
                                        and not self.other_kernel_from)


@dataclass(frozen=True)
class NativeSegments:
    """A linear layer whose output rows are segments, in order, each its own weight and kernel
    (a fused layer whose shards are stored in different formats): `apply` computes each
    segment's rows as that segment's kernel does."""
    segments: tuple[tuple[int, NativeLinear], ...]  # (its output rows, its weight)

    @property
    def batch_invariant(self) -> bool:
        """As NativeLinear.batch_invariant, for every segment."""
        return all(form.batch_invariant for _, form in self.segments)
