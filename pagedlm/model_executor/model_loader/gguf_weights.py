"""A GGUF file's weights as quantization="gguf" loads them: straight from the memory-mapped file.

Tensors of the block types the kernels run are handed over as :class:`GGUFBlocks`, whose blocks
are views of the file's pages wherever llama.cpp's layout needs no undoing (only Llama's q/k
rows are permuted, and those are copied in HF order). F16 and BF16 matrices, where asked for,
come the same way as float16 / bfloat16 tensors. Every other tensor (norms, biases, F32
matrices, anything whose layout is more than a row reordering) is dequantized to float32 under
its HF name, as the float path has it.

The map (the header reader's, gguf_header.py) is copy-on-write (np.memmap mode "c"): its views
are writable numpy arrays, which torch.from_numpy takes without a copy or a warning, while the
file itself can never be written.
"""

from __future__ import annotations

import json
import mmap
import os
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf.quants import dequantize

from pagedlm.model_executor.model_loader.gguf_header import GGUFHeader
from pagedlm.model_executor.model_loader.gguf_loader import (HF_NAMES_FILE, _gguf_shape,
                                                             add_zero_biases, float_state_dict,
                                                             open_architecture,
                                                             open_model_tensors)
from pagedlm.resolved_config import read_resolved_config

EMBEDDING = "token_embd.weight"
# The 2-byte float types `weights` hands over in their own dtype when asked to.
TWO_BYTE_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16}


@dataclass(frozen=True)
class GGUFBlocks:
    """A 2-D GGUF tensor (or rows of one) kept in its quantized blocks, rows in HF order.

    qtype: ggml's type name ("Q4_1", ...); blocks: uint8 [rows, blocks per row, block bytes]
    (ggml's block layout, blocks running along the input features); cols: the input features."""

    qtype: str
    blocks: torch.Tensor
    cols: int

    @property
    def shape(self) -> tuple[int, int]:
        """The float matrix's shape, so code that splits checkpoint tensors by rows works."""
        return (self.blocks.shape[0], self.cols)

    def split(self, sizes: list[int], dim: int = 0) -> tuple[GGUFBlocks, ...]:
        if dim != 0:
            raise ValueError("GGUF blocks split only by rows")
        return tuple(GGUFBlocks(self.qtype, b, self.cols) for b in self.blocks.split(sizes))

    def chunk(self, chunks: int, dim: int = 0) -> tuple[GGUFBlocks, ...]:
        return self.split([self.shape[0] // chunks] * chunks, dim)

    def dequantized(self) -> torch.Tensor:
        """Float32 [rows, cols], bit for bit gguf-py's dequantize (for a parameter that takes
        no blocks)."""
        from gguf import GGMLQuantizationType
        data = self.blocks.reshape(self.blocks.shape[0], -1).numpy()
        values = dequantize(data, GGMLQuantizationType[self.qtype])
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


class GGUFWeights:
    """One GGUF file, opened for loading its weights (header read and checked once)."""

    def __init__(self, gguf_path: str, metadata_dir: str | None = None,
                 header: GGUFHeader | None = None) -> None:
        """metadata_dir: the file's cached metadata directory, whose HF_NAMES_FILE spares
        finding the parameter names again; header: the file's header if already read (its
        map is the one the weights are viewed in)."""
        self.path = os.fspath(gguf_path)
        reader, arch, self.spec = open_architecture(self.path, header)
        hf_names = None
        names_file = metadata_dir and os.path.join(metadata_dir, HF_NAMES_FILE)
        if names_file and os.path.isfile(names_file):
            with open(names_file) as f:
                hf_names = set(json.load(f))
        # The directory's resolved config spares building the model type's config class,
        # whose imports cost seconds (resolved_config.py); finding the parameter names needs
        # that class itself.
        config = read_resolved_config(metadata_dir) if hf_names is not None else None
        (self.tensors, self.config, self.hf_names, self.processor,
         self.gguf_to_hf) = open_model_tensors(reader, arch, self.spec, hf_names, config)
        if names_file and hf_names is None:
            _save_names(names_file, self.hf_names)
        self._mmap, self._map = reader.mmap, reader.map

    def weights(self, block_types: set[str]) -> Iterator[tuple[str, GGUFBlocks | torch.Tensor]]:
        """(HF name, GGUFBlocks) for each 2-D tensor of a type in ``block_types`` whose layout
        is at most a reordering of rows (a float16 / bfloat16 tensor [rows, cols] for F16 and
        BF16), (HF name, float32 tensor) for all the others."""
        floats, rows = [], {}
        for name, tensor in self.tensors.items():
            hf_name = self.gguf_to_hf.get(name)
            order = (self._row_order(name, tensor) if tensor.tensor_type.name in block_types
                     and len(tensor.shape) == 2 and hf_name is not None else None)
            if order is None:
                floats.append(tensor)
                continue
            rows[hf_name] = len(order)
            qtype, blocks = tensor.tensor_type.name, self._blocks(tensor, order)
            if qtype in TWO_BYTE_DTYPES:  # [rows, cols, 2] bytes: one element a "block"
                yield hf_name, blocks.view(len(order), -1).view(TWO_BYTE_DTYPES[qtype])
            else:
                yield hf_name, GGUFBlocks(qtype, blocks, _gguf_shape(tensor)[1])
        state = float_state_dict(floats, self.processor, self.gguf_to_hf, self.spec)
        add_zero_biases(state, self.hf_names, {**rows, **{n: t.shape[0] for n, t in state.items()}})
        yield from state.items()

    def release_pages(self) -> None:
        """Drop the map's pages from this process: the blocks copied out of it (fused or
        permuted matrices) would otherwise count twice in its memory. Pages that layers still
        use as they are come back from the page cache on their next read."""
        if hasattr(mmap, "MADV_DONTNEED"):  # Linux; elsewhere the pages simply stay
            self._mmap.madvise(mmap.MADV_DONTNEED)

    def map_range(self) -> tuple[int, int]:
        """The first and past-the-last address of the file's map."""
        return self._map.ctypes.data, self._map.ctypes.data + len(self._map)

    def map_owner(self) -> object:
        """What keeps the file's map mapped while it is held."""
        return self._map

    def release(self, tensor: torch.Tensor) -> None:
        """Drop the map's pages under `tensor`, if it is a view of the map, once it has been
        copied (2-byte matrices packed into panels): without this every packed matrix's pages
        stayed in the process until release_pages, so loading an F16 file peaked at twice its
        size. Pages shared with a neighbour come back from the page cache on its next read."""
        start = tensor.data_ptr() - self._map.ctypes.data
        end = start + tensor.numel() * tensor.element_size()
        if hasattr(mmap, "MADV_DONTNEED") and 0 <= start < end <= len(self._map):
            first = start - start % mmap.PAGESIZE
            self._mmap.madvise(mmap.MADV_DONTNEED, first, end - first)

    def _row_order(self, name: str, tensor) -> np.ndarray | None:
        """The HF row order of a tensor whose llama.cpp layout is only a row permutation
        (transformers' own processor is run on the row indices), else None."""
        rows = _gguf_shape(tensor)[0]
        index = np.arange(rows, dtype=np.float32).reshape(rows, 1)
        processed = self.processor.process(weights=index, name=name,
                                           tensor_key_mapping=self.gguf_to_hf,
                                           parsed_parameters={"tensors": {}})
        if processed.name is None or np.shape(processed.weights) != (rows, 1):
            return None
        order = np.asarray(processed.weights).reshape(rows).astype(np.int64)
        return order if np.array_equal(np.sort(order), np.arange(rows)) else None

    def _blocks(self, tensor, order: np.ndarray) -> torch.Tensor:
        rows = len(order)
        data = self._map[tensor.data_offset:tensor.data_offset + tensor.n_bytes]
        blocks = torch.from_numpy(data).view(rows, -1, GGML_QUANT_SIZES[tensor.tensor_type][1])
        if np.array_equal(order, np.arange(rows)):
            return blocks  # the file's own pages
        return blocks[torch.from_numpy(order)]  # q/k rows back in HF order (a copy)



def _save_names(names_file: str, hf_names: set[str]) -> None:
    """Add the parameter names to a metadata directory cached before they were recorded there:
    finding them builds transformers' model class (~5 s of imports), on every load otherwise.
    Written whole or not at all; a read-only cache just goes without."""
    partial = f"{names_file}.{os.getpid()}.partial"
    try:
        with open(partial, "w") as f:
            json.dump(sorted(hf_names), f)
        os.replace(partial, names_file)
    except OSError:
        if os.path.exists(partial):
            os.remove(partial)
