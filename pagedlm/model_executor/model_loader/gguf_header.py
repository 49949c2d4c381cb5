"""A GGUF file's header read fast, for loading: tensor infos and metadata values on request.

gguf's GGUFReader decodes every metadata value up front, one numpy slice per string: ~4 s for a
49k-token vocabulary and its merges, which a load with a cached metadata directory never reads.
:func:`read_gguf_header` walks the header once with struct, decoding scalars and strings but
only skipping over arrays (decoded when asked for by key), and maps the file once for the
weights. It refuses the same bad files as :func:`gguf_file.open_gguf`, with the same messages.
GGUFReader stays where the whole metadata is needed (building the tokenizer, in transformers).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.gguf_reader import READER_SUPPORTED_VERSIONS

from pagedlm import mapped_blocks
from pagedlm.model_executor.model_loader.gguf_file import (_MIN_METADATA_ENTRY,
                                                           _MIN_TENSOR_ENTRY, _SCALAR_FORMATS,
                                                           check_file_start,
                                                           check_tensor_ranges)

_STRING = int(GGUFValueType.STRING)
_ARRAY = int(GGUFValueType.ARRAY)
_UINT32 = int(GGUFValueType.UINT32)
_SCALARS = {int(t): f for t, f in _SCALAR_FORMATS.items()}
_SCALAR_SIZES = {t: struct.calcsize(f) for t, f in _SCALARS.items()}
_DEFAULT_ALIGNMENT = 32
# How gguf's reader views each tensor type's data (anything else: the raw block bytes).
_ITEM_TYPES = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
               GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
               GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
               GGMLQuantizationType.I64: np.int64}


class _DoesNotFit(Exception):
    """A header read that runs past the end of the file."""


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor of the file, as gguf's ReaderTensor has it (shape: ggml's dims, fastest
    first; data_offset: absolute). ``data`` is a view of the mapped file."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray
    n_elements: int
    n_bytes: int
    data_offset: int
    file_map: np.ndarray

    @property
    def data(self) -> np.ndarray:
        dims = tuple(int(d) for d in reversed(self.shape.tolist()))
        raw = self.file_map[self.data_offset:self.data_offset + self.n_bytes]
        item_type = _ITEM_TYPES.get(self.tensor_type)
        if item_type is not None:
            return raw.view(item_type).reshape(dims)
        block, block_bytes = GGML_QUANT_SIZES[self.tensor_type]
        return raw.reshape(*dims[:-1], dims[-1] // block * block_bytes)


class GGUFHeader:
    """The header of one GGUF file and one copy-on-write map of it (np.memmap mode "c": views
    are writable numpy arrays, which torch.from_numpy takes without a copy, while the file
    itself is never written)."""

    def __init__(self, path: str, mapped: np.memmap) -> None:
        self.path = path
        self.mmap: mmap.mmap = mapped._mmap
        # A plain view: slicing an np.memmap runs its __array_finalize__ in Python each time.
        self.map: np.ndarray = mapped.view(np.ndarray)
        self.size = len(self.map)
        self.tensors: list[GGUFTensorInfo] = []
        self.alignment = _DEFAULT_ALIGNMENT
        self.data_offset = 0
        # key -> decoded value, or (type, offset) of an array decoded only when asked for.
        self._values: dict[str, Any] = {}
        self._arrays: dict[str, int] = {}
        self._order = "<"

    def value(self, key: str, default=None):
        """A metadata value as gguf's ReaderField.contents() gives it (arrays as lists)."""
        if key in self._arrays:
            return self._read_array(self._arrays[key])[0]
        return self._values.get(key, default)

    # -- the walk ------------------------------------------------------------------------
    def _unpack(self, fmt: str, offset: int):
        end = offset + struct.calcsize(fmt)
        if end > self.size:
            raise _DoesNotFit(f"a read of bytes [{offset}, {end}) runs past its end")
        return struct.unpack_from(self._order + fmt, self.mmap, offset)

    def _string(self, offset: int) -> tuple[str, int]:
        (length,) = self._unpack("Q", offset)
        end = offset + 8 + length
        if end > self.size:
            raise _DoesNotFit(f"a read of bytes [{offset + 8}, {end}) runs past its end")
        return self.mmap[offset + 8:end].decode("utf-8"), end

    def _scalar(self, value_type: int, offset: int) -> tuple[Any, int]:
        if value_type == _STRING:
            return self._string(offset)
        fmt = _SCALARS.get(value_type)
        if fmt is None:
            raise ValueError(f"unknown metadata value type {value_type} at byte {offset}")
        return self._unpack(fmt, offset)[0], offset + _SCALAR_SIZES[value_type]

    def _array_bounds(self, offset: int) -> tuple[int, int, int]:
        item_type, count = self._unpack("I", offset)[0], self._unpack("Q", offset + 4)[0]
        item_bytes = _SCALAR_SIZES.get(item_type) or (8 if item_type == _STRING else 12)
        if item_type not in _SCALAR_SIZES and item_type not in (_STRING, _ARRAY):
            raise ValueError(f"unknown metadata value type {item_type} at byte {offset}")
        if count * item_bytes > self.size - offset - 12:
            raise _DoesNotFit(f"a metadata array at byte {offset} says {count} entries, more "
                              f"than the {self.size - offset - 12} bytes left after byte "
                              f"{offset + 12} can hold")
        return item_type, count, offset + 12

    def _skip_array(self, offset: int) -> int:
        item_type, count, offset = self._array_bounds(offset)
        if item_type in _SCALAR_SIZES:
            return offset + count * _SCALAR_SIZES[item_type]
        if item_type == _STRING:
            # The hot loop (~100k vocabulary and merge strings): struct.error on a length read
            # past the end, one bound check for the lengths' sum at the end.
            length_at, m = struct.Struct(self._order + "Q").unpack_from, self.mmap
            try:
                for _ in range(count):
                    offset += 8 + length_at(m, offset)[0]
            except struct.error:
                raise _DoesNotFit(f"a string length read at byte {offset} runs past its end"
                                  ) from None
            if offset > self.size:
                raise _DoesNotFit(f"a metadata string array ends at byte {offset}, past its end")
            return offset
        for _ in range(count):
            offset = self._skip_array(offset)
        return offset

    def _read_array(self, offset: int) -> tuple[list, int]:
        item_type, count, offset = self._array_bounds(offset)
        if item_type in _SCALAR_SIZES:
            fmt = f"{self._order}{count}{_SCALARS[item_type]}"
            return list(struct.unpack_from(fmt, self.mmap, offset)), \
                offset + count * _SCALAR_SIZES[item_type]
        items = []
        for _ in range(count):
            if item_type == _STRING:
                item, offset = self._string(offset)
            else:
                item, offset = self._read_array(offset)
            items.append(item)
        return items, offset

    def _walk(self) -> None:
        (version,) = self._unpack("I", 4)
        if version & 0xFFFF == 0:  # written for the other byte order
            self._order = ">"
            (version,) = self._unpack("I", 4)
        if version not in READER_SUPPORTED_VERSIONS:
            raise ValueError(f"GGUF version {version} is not supported")
        tensor_count, kv_count = self._unpack("QQ", 8)
        _fits(tensor_count, _MIN_TENSOR_ENTRY, 24, self.size, "the tensor count")
        _fits(kv_count, _MIN_METADATA_ENTRY, 24, self.size, "the metadata count")
        offset, types = 24, {}
        for _ in range(kv_count):
            key, offset = self._string(offset)
            if key in types:
                raise ValueError(f"metadata key {key!r} appears twice")
            (value_type,) = self._unpack("I", offset)
            types[key] = value_type
            if value_type == _ARRAY:
                self._arrays[key] = offset + 4
                offset = self._skip_array(offset + 4)
            else:
                self._values[key], offset = self._scalar(value_type, offset + 4)
        _fits(tensor_count, _MIN_TENSOR_ENTRY, offset, self.size, "the tensor count")
        entries = []
        for _ in range(tensor_count):
            name, offset = self._string(offset)
            (dims,) = self._unpack("I", offset)
            shape = self._unpack(f"{dims}Q", offset + 4)
            offset += 4 + 8 * dims
            raw_type, data_offset = self._unpack("IQ", offset)[0], self._unpack("Q", offset + 4)[0]
            offset += 12
            entries.append((name, raw_type, shape, data_offset))
        if len({name for name, *_ in entries}) != len(entries):
            raise ValueError("a tensor name appears twice")
        if "general.alignment" in types:
            if types["general.alignment"] != _UINT32:
                raise ValueError("general.alignment is not a UINT32")
            self.alignment = self._values["general.alignment"]
            if self.alignment == 0 or self.alignment & (self.alignment - 1):
                raise ValueError(f"alignment {self.alignment} is not a power of two")
        self.data_offset = -(-offset // self.alignment) * self.alignment
        check_tensor_ranges(entries, self.data_offset, self.alignment, self.size)
        for name, raw_type, shape, data_offset in entries:
            qtype = GGMLQuantizationType(raw_type)
            block, block_bytes = GGML_QUANT_SIZES[qtype]
            n = int(np.prod(shape, dtype=np.int64)) if shape else 1
            self.tensors.append(GGUFTensorInfo(
                name, qtype, np.array(shape, dtype=np.uint64), n, n // block * block_bytes,
                self.data_offset + data_offset, self.map))


def _fits(count: int, min_bytes: int, offset: int, size: int, what: str) -> None:
    if count * min_bytes > size - offset:
        raise _DoesNotFit(f"{what} says {count} entries, more than the {size - offset} bytes "
                          f"left after byte {offset} can hold")


def read_gguf_header(path: str | os.PathLike) -> GGUFHeader:
    """The header of the GGUF file at ``path``, checked as :func:`gguf_file.open_gguf` checks
    it (ValueError naming the file and the fault), and the file mapped once."""
    path = os.fspath(path)
    size = check_file_start(path)
    mapped = np.memmap(path, mode="c")
    mapped_blocks.advise_file_map(mapped._mmap)  # before the blocks' pages are first read
    header = GGUFHeader(path, mapped)
    try:
        header._walk()
    except (_DoesNotFit, struct.error) as e:
        raise ValueError(f"{path}: truncated or corrupt GGUF file of {size} bytes: {e}.") from e
    except (ValueError, OverflowError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: corrupt GGUF file: {e}.") from e
    except RecursionError as e:  # arrays of arrays: real files nest one level at most
        raise ValueError(f"{path}: corrupt GGUF file: metadata arrays nested too deeply to "
                         f"read.") from e
    return header
