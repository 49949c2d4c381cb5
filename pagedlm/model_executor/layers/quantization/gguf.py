"""quantization="gguf": a GGUF file's weights run as stored, read from the memory-mapped file.

The model is built without float weights for its linear layers and token embedding
(linear_method.weights_on_meta): each such weight is a placeholder on the meta device that receives
whatever the file has for it, so memory holds the file's blocks and never a float copy of them.
Blocks of a type the kernels run (RUNNABLE_TYPES) are kept as they are, as views of the file's
pages where nothing needs reordering or joining. F16 and BF16 matrices stay 2 bytes a weight
(TWO_BYTE_FORMATS): a layer all of one of them runs on panels of that dtype through the float
method, as a dtype="bfloat16" checkpoint does; the panel kernel widens them exactly, so the
result is the float32 kernel's bits on the widened weight. A layer that gets an F32 tensor (or
a layout other than a row reordering, or F16/BF16 where the build has no panel kernel) gets a
float32 weight then, and runs on the float path with any other shards widened into it.

Fused layers (q/k/v, gate/up): the shards stay apart (views of the file where nothing needs
reordering), each multiplied in its own format into its slice of the output
(GGUFShardedLinearMethod); Q4_K_M files have v or down Q6_K beside q/k Q4_K in some layers.
An F16 or BF16 shard beside shards of other types runs on its own panels there.

The token embedding stays in its blocks: a lookup gathers the ids' block rows and dequantizes
only those (for a 128k-vocabulary 8B model a float table would be 2.1 GB). A tied LM head
multiplies by the same blocks. In the embedded SmolLM2 file that head is Q8_0 and 20% of all
weights: kept float it would be read at 4 bytes a weight, more than all the Q4_1 layers together
(113 MB against 66 MB a token).
An F16 or BF16 table is looked up in its own dtype, from the file's pages; a tied head on it
runs on its own panels.

Tensor parallelism: each rank keeps its slice of the blocks, cut by the layers' own weight
loaders (output rows, vocabulary ranges) or along block boundaries (a row-parallel layer's
input features; a split that would cut a block is refused, naming the layer).
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from pagedlm import envs, huge_pages, mapped_blocks
from pagedlm.kernels import gemv
from pagedlm.model_executor.layers.linear import RowParallelLinear
from pagedlm.model_executor.layers.linear_method import LinearMethodBase, UnquantizedLinearMethod
from pagedlm.model_executor.layers.native_linear import (PANEL_FORMATS, NativeLinear,
                                                         NativeSegments)
import pagedlm.model_executor.layers.quantization.kernels as kernels
from pagedlm.model_executor.layers.quantization.base import (NATIVE_FORMATS, PackedLinearMethod,
                                                            QuantizationConfig)
from pagedlm.model_executor.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedlm.model_executor.model_loader.model_path import gguf_source
from pagedlm.model_executor.model_loader.weight_utils import WeightShapeError

logger = logging.getLogger(__name__)

# ggml type -> the kernel format its blocks run in: every format the kernels have, under its
# ggml name, and Q4_0, which converts to q4_1 exactly.
RUNNABLE_TYPES = {"Q4_0": "q4_1", **{fmt.upper(): fmt for fmt in kernels.FORMATS if fmt != "i8"}}
FLOAT_TYPES = ("F32", "F16", "BF16")
# The parts' formats of F16 and BF16 matrices, which the file hands over as 2-byte tensors
# (gguf_weights.py) and the layers keep in that dtype: one weight a "block".
TWO_BYTE_FORMATS = {"f16": torch.float16, "bf16": torch.bfloat16}
_TWO_BYTE_FORMAT_OF = {dtype: fmt for fmt, dtype in TWO_BYTE_FORMATS.items()}
# quantization=None on a GGUF file whose float32 copy would exceed this keeps it quantized
# ("gguf"); below it the file is dequantized to float32. About 500M parameters: a 1B+ model's
# float copy is 4+ GB and runs about 4x slower per token than its blocks, while for the
# embedded 135M model float32 is the fastest path at batch sizes of 128.
GGUF_FLOAT_COPY_LIMIT_BYTES = 2 << 30


def default_for_gguf(gguf_path: str) -> str | None:
    """What quantization=None means for a GGUF file: None (float32) when its float32 copy is
    at most GGUF_FLOAT_COPY_LIMIT_BYTES, else "gguf"; a large file with tensor types the
    kernels cannot run is refused, naming them."""
    from pagedlm.model_executor.model_loader.gguf_file import check_runnable_types
    from pagedlm.model_executor.model_loader.gguf_header import read_gguf_header
    header = read_gguf_header(gguf_path)  # without decoding its metadata arrays
    size = 4 * sum(t.n_elements for t in header.tensors)
    if size <= GGUF_FLOAT_COPY_LIMIT_BYTES:
        return None
    try:
        check_runnable_types(header, set(RUNNABLE_TYPES) | set(FLOAT_TYPES))
    except ValueError as e:
        raise ValueError(f"{e} Its float32 copy would take {size / 2**30:.1f} GiB, more than "
                         f"the {GGUF_FLOAT_COPY_LIMIT_BYTES / 2**30:.0f} GiB up to which "
                         f"pagedlm dequantizes a GGUF file by default.") from None
    return "gguf"


def block_weights(fmt: str) -> int:
    """Input features per block of a kernel format (1 for a 2-byte float one)."""
    return 1 if fmt in TWO_BYTE_FORMATS else kernels.BLOCK_WEIGHTS[fmt]


def _dequantize(fmt: str, blocks: torch.Tensor) -> torch.Tensor:
    """Float32 rows of a part in format `fmt` (2-byte floats widen exactly)."""
    return blocks.float() if fmt in TWO_BYTE_FORMATS else kernels.dequantize(fmt, blocks)


def _has_panels(fmt: str) -> bool:
    """Whether a part of format `fmt` can run as it is (a 2-byte one needs the panel kernel)."""
    return fmt not in TWO_BYTE_FORMATS or TWO_BYTE_FORMATS[fmt] in gemv.panel_dtypes()


@dataclass(frozen=True)
class _Part:
    """What the file gave a weight for one shard: this rank's blocks (for a 2-byte format the
    [rows, cols] matrix itself), placed at output row `offset`, or a full float tensor for the
    layer's own loader."""
    shard: object
    fmt: str | None = None
    offset: int = 0
    blocks: torch.Tensor | None = None
    floats: torch.Tensor | None = None


def _make_receiver(param: nn.Parameter, module: nn.Module) -> None:
    """Turn a (meta) float weight into the placeholder that collects the file's parts."""
    if getattr(param, "gguf_parts", None) is not None:
        return  # an LM head tied to the embedding: one parameter, already collecting
    param.gguf_parts = []
    param.takes_blocks = True
    param.weight_loader = functools.partial(_receive, module)


def _receive(module: nn.Module, param: nn.Parameter, loaded, shard_id: object = None) -> None:
    if hasattr(loaded, "qtype"):
        fmt = RUNNABLE_TYPES[loaded.qtype]
        blocks = kernels.q4_0_to_q4_1(loaded.blocks) if loaded.qtype == "Q4_0" else loaded.blocks
        got = loaded.cols
    elif loaded.dim() == 2 and loaded.dtype in _TWO_BYTE_FORMAT_OF:
        fmt, blocks, got = _TWO_BYTE_FORMAT_OF[loaded.dtype], loaded, loaded.shape[1]
    else:
        param.gguf_parts.append(_Part(shard_id, floats=loaded))
        return
    cols = module.input_size if isinstance(module, RowParallelLinear) else param.shape[1]
    if got != cols:
        raise WeightShapeError(tuple(loaded.shape), (loaded.shape[0], cols))
    offset, local = _local_blocks(module, param, blocks, fmt, shard_id)
    param.gguf_parts.append(_Part(shard_id, fmt, offset, local))


def _local_blocks(module, param, blocks: torch.Tensor, fmt: str, shard_id: object):
    """(output row, blocks) of this rank's part of a full shard, sliced as the layer's own
    weight loader slices a float tensor."""
    if isinstance(module, RowParallelLinear):
        if module.tp_size == 1:
            return 0, blocks
        n, per_block = module.input_size_per_partition, block_weights(fmt)
        if n % per_block:
            raise ValueError(
                f"quantization='gguf': tensor_parallel_size={module.tp_size} splits the "
                f"{module.input_size} input features of {module.quant_prefix} into {n} per "
                f"rank, not a multiple of its {per_block}-weight {fmt} blocks; choose a "
                f"tensor_parallel_size that keeps the blocks whole.")
        return 0, blocks.narrow(1, module.tp_rank * n // per_block, n // per_block).contiguous()
    # The layer's loader run on row numbers (1-based; 0: not filled) says which rows of the
    # full tensor land where on this rank (q/k/v heads, replicated KV heads, vocab ranges).
    probe = torch.zeros(param.shape[0], 1, dtype=torch.int64)
    module.weight_loader(probe, torch.arange(1, blocks.shape[0] + 1).reshape(-1, 1), shard_id)
    filled = probe[:, 0].nonzero()[:, 0]
    if len(filled) == 0:
        return 0, blocks[:0]
    offset, start = int(filled[0]), int(probe[filled[0], 0]) - 1
    return offset, blocks.narrow(0, start, len(filled))


def _float_weight(module: nn.Module, receiver: nn.Parameter) -> nn.Parameter:
    """The receiver's parts as one float32 weight (made once for a tied embedding and head)."""
    weight = getattr(receiver, "gguf_float", None)
    if weight is not None:
        return weight
    weight = nn.Parameter(torch.zeros(receiver.shape, dtype=torch.float32), requires_grad=False)
    for part in receiver.gguf_parts:
        if part.floats is not None:
            module.weight_loader(weight, part.floats, part.shard)
        else:
            rows = part.blocks.shape[0]
            weight.data[part.offset:part.offset + rows] = _dequantize(part.fmt, part.blocks)
    receiver.gguf_float = weight
    return weight


class GGUFLinearMethod(PackedLinearMethod):
    """A linear layer on the file's blocks (see the module docstring). release: called with
    each part of the file a 2-byte layer has copied into its panels (GGUFWeights.release)."""

    def __init__(self, *, deterministic: bool = False,
                 release: Callable[[torch.Tensor], None] | None = None) -> None:
        super().__init__(deterministic=deterministic)
        self._release = release

    def attach(self, layer: nn.Module) -> None:
        _make_receiver(layer.weight, layer)
        layer.keep_float_weight = False  # the receiver holds no memory; nothing to keep

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        receiver = layer.weight
        parts = sorted(receiver.gguf_parts, key=lambda p: p.offset)
        if not parts or any(p.floats is not None or not _has_panels(p.fmt) for p in parts):
            self._run_float(layer, _float_weight(layer, receiver))
            return
        formats = sorted({p.fmt for p in parts})
        blocks = [p.blocks for p in parts]
        missing = receiver.shape[0] - sum(b.shape[0] for b in blocks)
        two_byte = len(formats) == 1 and formats[0] in TWO_BYTE_FORMATS
        if len(parts) > 1 and not missing and not two_byte:
            # Shards stay apart even in one format: joining them copied every fused layer out
            # of the map at each load (torch.cat of 300 MB, about 1 s of a 1B Q4_K_M start).
            # A 2-byte shard among them is packed into its own panels.
            layer.linear_method = GGUFShardedLinearMethod(deterministic=self.deterministic)
            layer.quant_format = "+".join(formats)
            layer.quant_rows = receiver.shape[0]
            layer.quant_shards = tuple(
                (p.fmt, p.offset, gemv.pack_panels(p.blocks.contiguous())
                 if p.fmt in TWO_BYTE_FORMATS else p.blocks.contiguous()) for p in parts)
            layer.register_parameter("weight", None)
            self._released([p for p in parts if p.fmt in TWO_BYTE_FORMATS])
            return
        if missing and layer.tp_size > 1:
            # A vocabulary's padding rows on the last rank: the ranks' logits are gathered in
            # equal slices. Zero blocks are zero weights in every format.
            blocks.append(torch.zeros(missing, *blocks[0].shape[1:], dtype=blocks[0].dtype))
        # One part: the file's own pages, no copy (a view is contiguous unless TP cut it).
        joined = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
        if two_byte:
            # F16 or BF16 throughout: the float method's panels of that dtype, which are then
            # all it keeps (2 bytes a weight), as for a dtype="bfloat16" checkpoint.
            self._run_float(layer, nn.Parameter(joined.contiguous(), requires_grad=False))
            self._released(parts)
            return
        self._blocks = (formats[0], joined)
        super().process_weights_after_loading(layer)
        del self._blocks

    def _released(self, parts: list[_Part]) -> None:
        for part in parts:
            if self._release is not None:
                self._release(part.blocks)

    def _run_float(self, layer: nn.Module, weight: nn.Parameter) -> None:
        """The layer on the float method with `weight` (float32, or 2 bytes on panels)."""
        layer.weight = weight
        layer.linear_method = UnquantizedLinearMethod(deterministic=self.deterministic)
        layer.linear_method.process_weights_after_loading(layer)

    def pack(self, layer):
        fmt, blocks = self._blocks
        return fmt, blocks.contiguous(), None


def _shards(layer: nn.Module):
    """(format, first row, rows, data) of each shard of a GGUFShardedLinearMethod layer: the
    shards cover its rows in order (a 2-byte shard's panels may have padding columns)."""
    shards = layer.quant_shards
    ends = [row for _, row, _ in shards[1:]] + [layer.quant_rows]
    return [(fmt, row, end - row, data) for (fmt, row, data), end in zip(shards, ends)]


class GGUFShardedLinearMethod(LinearMethodBase):
    """A fused layer kept as its shards: each shard's rows run in its own format into its
    slice of the output (layer.quant_shards: (format, row, blocks, or a 2-byte shard's
    panels))."""

    def __init__(self, *, deterministic: bool = False) -> None:
        super().__init__(deterministic=deterministic)
        self.precise_activations = envs.PAGEDLM_PRECISE_ACTIVATIONS  # as PackedLinearMethod's

    def create_weights(self, *args, **kwargs) -> None:
        raise NotImplementedError("set after loading by GGUFLinearMethod")

    def apply(self, layer, x, bias=None) -> torch.Tensor:
        y = x.new_empty(*x.shape[:-1], layer.quant_rows, dtype=torch.float32)
        for fmt, row, rows, data in _shards(layer):
            if fmt in TWO_BYTE_FORMATS:
                out = gemv.gemm_panels(x.reshape(-1, x.shape[-1]).float(), data, rows)
                y[..., row:row + rows] = out.view(*x.shape[:-1], rows)
            else:
                y[..., row:row + rows] = kernels.quantized_matmul(
                    fmt, x, data, batch_invariant=self.deterministic,
                    precise_activations=self.precise_activations)
        if bias is not None:
            y += bias
        return y.to(x.dtype)

    def native_form(self, layer) -> NativeSegments | None:
        segments = []
        for fmt, _, rows, data in _shards(layer):
            if fmt in TWO_BYTE_FORMATS:
                segments.append((rows, NativeLinear(PANEL_FORMATS[data.dtype], data)))
                continue
            native = NATIVE_FORMATS.get(fmt)
            if native is None or data.shape[0] != rows:
                return None  # a format no kernel of the stack runs, or rows it leaves unset
            segments.append((rows, NativeLinear(
                native, data, every_row_count=self.deterministic,
                two_limbs=kernels.activation_limbs(fmt, self.precise_activations) == 2)))
        return NativeSegments(tuple(segments))


class _BlockRows:
    """Embedding lookups on a table kept in blocks (or 2-byte floats): only the ids' rows are
    dequantized."""

    def __init__(self, fmt: str, blocks: torch.Tensor, dim: int) -> None:
        self.fmt, self.blocks, self.dim = fmt, blocks, dim

    def __call__(self, local_ids: torch.Tensor) -> torch.Tensor:
        rows = self.blocks.shape[0]
        if rows == 0:  # a rank whose range is all padding
            return torch.zeros(*local_ids.shape, self.dim)
        # Ids past the real rows only come from the padding, which no token has.
        ids = local_ids.reshape(-1).clamp(max=rows - 1)
        out = _dequantize(self.fmt, self.blocks.index_select(0, ids))
        return out.reshape(*local_ids.shape, self.dim)


class GGUFConfig(QuantizationConfig):
    name = "gguf"
    weights_from_file = True

    def __init__(self, gguf_path: str, *, deterministic: bool = False,
                 metadata_dir: str | None = None, header=None) -> None:
        """header: the file's GGUFHeader if already read; the weights reuse it and its map."""
        super().__init__(deterministic=deterministic)
        self.gguf_path, self.metadata_dir = gguf_path, metadata_dir
        self._header, self._file = header, None
        self.blocks_in_place = envs.PAGEDLM_GGUF_IN_PLACE

    @classmethod
    def from_model_dir(cls, model_dir: str, *, deterministic: bool = False) -> "GGUFConfig":
        from pagedlm.model_executor.model_loader.gguf_file import check_runnable_types
        from pagedlm.model_executor.model_loader.gguf_header import read_gguf_header
        path = gguf_source(model_dir)
        if path is None:
            raise ValueError(f"quantization='gguf' needs a GGUF model file (model=PATH.gguf); "
                             f"{model_dir} is a HuggingFace directory. Use 'int8' or 'int4' "
                             f"to quantize it.")
        header = read_gguf_header(path)
        check_runnable_types(header, set(RUNNABLE_TYPES) | set(FLOAT_TYPES))
        return cls(path, deterministic=deterministic, metadata_dir=model_dir, header=header)

    def apply(self, model: nn.Module) -> None:
        for module in model.modules():
            if (isinstance(module, VocabParallelEmbedding)
                    and not isinstance(module, ParallelLMHead)):
                _make_receiver(module.weight, module)
        super().apply(model)

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        return GGUFLinearMethod(deterministic=self.deterministic, release=self._release)

    def _release(self, tensor: torch.Tensor) -> None:
        if self._file is not None:
            self._file.release(tensor)

    def weights(self, float_weights):
        from pagedlm.model_executor.model_loader.gguf_weights import GGUFWeights
        # The float weights (a converted directory's) are not read: everything is in the file.
        self._file = GGUFWeights(self.gguf_path, self.metadata_dir, self._header)
        self._header = None  # read once per load; the weights hold the map from here
        # F16 and BF16 matrices come as 2-byte tensors (see the module docstring).
        yield from self._file.weights(set(RUNNABLE_TYPES) | {"F16", "BF16"})

    def process_weights_after_loading(self, model: nn.Module) -> None:
        for module in model.modules():
            if (not isinstance(module, VocabParallelEmbedding) or isinstance(module, ParallelLMHead)
                    or module.weight is None):
                continue
            receiver = module.weight
            parts = receiver.gguf_parts
            if len(parts) == 1 and parts[0].blocks is not None:
                module.row_lookup = _BlockRows(parts[0].fmt, parts[0].blocks.contiguous(),
                                               module.embedding_dim)
                module.weight = None
            else:
                module.weight = _float_weight(module, receiver)
        if self._file is None:
            return
        # The blocks the steps stream go on huge pages (on the CPU; mapped_blocks.gather_blocks
        # says what that gains). Those still in the file's map stay there, and once it is
        # loaded a thread moves the pages under them onto fresh huge pages
        # (mapped_blocks.FileMapMove: the addresses stay, so the model runs meanwhile); the
        # others (permuted rows, a worker's shards) are copied now, each one's file pages
        # dropped as it is copied, so the process never holds a weight twice. With
        # PAGEDLM_GGUF_IN_PLACE, blocks stay in the file's map where its pages are 2 MiB
        # folios, for good.
        mapped = self._file.map_range()
        move = not self.blocks_in_place and huge_pages.supported()
        mapped_blocks.gather_blocks(model, release=self._release, in_place=self.blocks_in_place,
                                 stay_in=mapped if move else None)
        # Before the move: it would zero the moved (anonymous) pages.
        self._file.release_pages()
        if move:
            spans = [(t.data_ptr(), t.nbytes) for t in
                     mapped_blocks.blocks_within(mapped_blocks.streamed_blocks(model), *mapped)]
            if spans:  # the model keeps it, for whoever needs the move to have ended
                model.blocks_move = mapped_blocks.FileMapMove(self._file.map_owner(), *mapped,
                                                           spans)
        self._file = None
