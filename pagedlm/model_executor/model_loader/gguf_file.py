"""Opening a GGUF file: its header read and checked before anything else touches it.

gguf's own reader trusts the header. On a truncated or corrupt file it fails with whatever
numpy or Python error the first bad read happens to raise, or, where a wrong count or offset
still lands inside the file, hands back tensors made of other bytes. :func:`open_gguf` bounds
every read by the file's size and checks the tensors' data against it, so such a file is
refused with one ValueError that names the file and what is wrong with it.
"""

from __future__ import annotations

import mmap
import os
import struct

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType

_MAGIC = b"GGUF"
# magic, version, tensor count, metadata count.
_HEADER_BYTES = 4 + 4 + 8 + 8
# The fewest bytes one entry can take: a metadata entry is a key (8-byte length), a 4-byte
# type and a value of at least one byte; a tensor entry a name (8-byte length), a 4-byte
# dimension count, a 4-byte type and an 8-byte offset. Counts that cannot fit the file are
# refused up front rather than looped over.
_MIN_METADATA_ENTRY = 8 + 4 + 1
_MIN_TENSOR_ENTRY = 8 + 4 + 4 + 8
# The smallest encoding of one element of a metadata array, by element type.
_MIN_ARRAY_ITEM = {GGUFValueType.STRING: 8, GGUFValueType.ARRAY: 4 + 8}
# A plain int: comparing with an enum member looks it up through Enum's slow __getattr__.
_ARRAY = int(GGUFValueType.ARRAY)


class _DoesNotFit(Exception):
    """A header read, or a count of entries, that runs past the end of the file."""


class _PlainArrayGGUFReader(GGUFReader):
    """GGUFReader over a plain ndarray view of its memory map instead of the np.memmap itself,
    with every read bounded by the file's size.

    Every slice of an np.memmap runs memmap.__array_finalize__ in Python. GGUFReader slices
    once per metadata string (~100k for a 49k-token vocabulary plus merges) and the
    dequantizers slice each tensor into many row groups, which made reading ~4x and
    dequantizing ~2x slower. The view shares the same mapped pages and keeps the map alive.
    """

    def __init__(self, path: str):
        self.path = path
        super().__init__(path)

    @property
    def data(self) -> np.ndarray:
        return self._plain_data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain_data = value.view(np.ndarray)

    def _get(self, offset, dtype, count=1, override_order=None):
        # gguf's _get with the bound added: numpy slicing past the end silently shortens the
        # slice, and gguf then fails somewhere later, or not at all. Inlined rather than a
        # super() call: it runs twice per metadata string.
        count = int(count)
        end = int(offset) + np.dtype(dtype).itemsize * count
        data = self._plain_data
        if end > data.shape[0]:
            raise _DoesNotFit(f"a read of bytes [{int(offset)}, {end}) runs past its end")
        arr = data[offset:end].view(dtype=dtype)[:count]
        order = self.byte_order if override_order is None else override_order
        return arr.view(arr.dtype.newbyteorder(order))

    def _get_field_parts(self, orig_offs, raw_type):
        if raw_type == _ARRAY:
            item_type = int(self._get(orig_offs, np.uint32)[0])
            length = int(self._get(orig_offs + 4, np.uint64)[0])
            scalar = self.gguf_scalar_to_np.get(_value_type(item_type, orig_offs))
            item_bytes = (np.dtype(scalar).itemsize if scalar is not None
                          else _MIN_ARRAY_ITEM.get(GGUFValueType(item_type), 1))
            _check_count(length, item_bytes, orig_offs + 12, self._plain_data.shape[0],
                         f"a metadata array at byte {orig_offs}")
        return super()._get_field_parts(orig_offs, raw_type)

    def _build_fields(self, offs, count):
        _check_count(int(count), _MIN_METADATA_ENTRY, offs, self._plain_data.shape[0],
                     "the metadata count")
        return super()._build_fields(offs, count)

    def _build_tensor_info(self, offs, count):
        _check_count(int(count), _MIN_TENSOR_ENTRY, offs, self._plain_data.shape[0],
                     "the tensor count")
        return super()._build_tensor_info(offs, count)

    def _build_tensors(self, start_offs, fields):
        entries = [(bytes(f.parts[1]).decode("utf-8", errors="replace"), int(f.parts[4][0]),
                    f.parts[3].tolist(), int(f.parts[5][0])) for f in fields]
        check_tensor_ranges(entries, start_offs, self.alignment, self._plain_data.shape[0])
        super()._build_tensors(start_offs, fields)


def open_gguf(path: str | os.PathLike) -> GGUFReader:
    """A reader over the GGUF file at ``path`` (memory-mapped; nothing is copied).

    Raises ValueError naming the file and the fault for a missing or empty file, a wrong
    magic, a truncated header, counts or offsets that do not fit the file, an unknown tensor
    type, or tensor data that overlaps or runs past the end of the file.
    """
    path = os.fspath(path)
    size = check_file_start(path)
    try:
        return _PlainArrayGGUFReader(path)
    except _DoesNotFit as e:
        raise ValueError(f"{path}: truncated or corrupt GGUF file of {size} bytes: {e}.") from e
    except (ValueError, KeyError, IndexError, OverflowError, TypeError) as e:
        # gguf's own checks (version, duplicate names, alignment) and numpy's failures on
        # bytes that are not what the header says.
        raise ValueError(f"{path}: corrupt GGUF file: {e}.") from e
    except RecursionError as e:  # arrays of arrays: real files nest one level at most
        raise ValueError(f"{path}: corrupt GGUF file: metadata arrays nested too deeply to "
                         f"read.") from e


def check_file_start(path: str) -> int:
    """The size of the file at ``path``; ValueError for a missing or unreadable file, one too
    short for a GGUF header, or one without GGUF's magic."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ValueError(f"{path}: cannot read the GGUF file ({e.strerror or e}).") from e
    if size < _HEADER_BYTES:
        raise ValueError(f"{path}: truncated GGUF file: {size} bytes, fewer than the "
                         f"{_HEADER_BYTES} of a GGUF header.")
    if magic != _MAGIC:
        raise ValueError(f"{path}: not a GGUF file: it starts with {magic!r}, not the GGUF "
                         f"magic {_MAGIC!r} (a corrupt file, or another format).")
    return size


def check_runnable_types(reader: GGUFReader, runnable: set[str]) -> None:
    """Refuse a file with tensors of a type outside ``runnable`` (ggml type names, any case),
    naming the tensors, their types and the supported list. Reads only the header."""
    allowed = {t.upper() for t in runnable}
    bad = [(t.name, t.tensor_type.name) for t in reader.tensors
           if t.tensor_type.name not in allowed]
    if not bad:
        return
    shown = ", ".join(f"{name!r} ({qtype})" for name, qtype in bad[:4])
    more = f" and {len(bad) - 4} more" if len(bad) > 4 else ""
    types = ", ".join(sorted({qtype for _, qtype in bad}))
    where = getattr(reader, "path", "GGUF file")
    raise ValueError(f"{where}: tensor type {types} is not supported: tensor{'s' * (len(bad) > 1)} "
                     f"{shown}{more} (supported types: {', '.join(sorted(allowed))}).")


def _value_type(raw: int, offset: int) -> GGUFValueType:
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise ValueError(f"unknown metadata value type {raw} at byte {offset}") from None


def _check_count(count: int, min_bytes: int, offset: int, size: int, what: str) -> None:
    if count * min_bytes > size - offset:
        raise _DoesNotFit(f"{what} says {count} entries, more than the {size - offset} bytes "
                         f"left after byte {offset} can hold")


def check_tensor_ranges(entries, start: int, alignment: int, size: int) -> None:
    """Every tensor's data within the file and apart from the others', and no more unclaimed
    bytes after the last one than alignment padding: a tensor count that is too small moves
    the data section's start, and the tensors would be read from the wrong bytes.

    entries: (name, ggml type id, dims fastest first, data offset) of each tensor."""
    ranges = []
    for name, raw_type, dims, offset in entries:
        try:
            qtype = GGMLQuantizationType(raw_type)
            block, block_bytes = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise ValueError(f"tensor {name!r} has unknown ggml type id {raw_type}") from None
        elements = 1
        for d in dims:
            elements *= int(d)
        if elements % block:
            raise ValueError(f"tensor {name!r} ({qtype.name}) has {elements} elements, not a "
                             f"whole number of its {block}-element blocks")
        begin = start + offset
        end = begin + elements // block * block_bytes
        if end > size:
            raise ValueError(
                f"tensor {name!r} ({qtype.name}, shape {list(reversed(list(dims)))}) needs "
                f"bytes [{begin}, {end}) but the file has {size}: a truncated file, or a wrong "
                "tensor count or offset")
        ranges.append((begin, end, name))
    ranges.sort()
    for (_, end, name), (begin, _, other) in zip(ranges, ranges[1:]):
        if begin < end:
            raise ValueError(f"tensors {name!r} and {other!r} overlap in the file: a wrong "
                             "tensor count or offset")
    last = max((end for _, end, _ in ranges), default=start)
    if size - last >= alignment and ranges:
        raise ValueError(f"{size - last} bytes after the last tensor's data belong to no "
                         f"tensor ({len(ranges)} listed): a wrong tensor count or offset")


# struct formats of GGUF's scalar value types, for the header walk below.
_SCALAR_FORMATS = {GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
                   GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
                   GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?",
                   GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q",
                   GGUFValueType.FLOAT64: "d"}
_SCALAR_BYTES = {int(t): struct.calcsize(f) for t, f in _SCALAR_FORMATS.items()}
_STRING = int(GGUFValueType.STRING)


def gguf_element_count(path: str | os.PathLike) -> int:
    """How many weights the file's tensors hold, from its header alone.

    A walk over the header that skips the metadata values without decoding them: open_gguf
    takes ~1.5 s on a 49k-token vocabulary's strings, this ~0.1 s. Raises ValueError for a
    header that does not fit the file."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return _count_elements(m)
    except (OSError, ValueError, struct.error, IndexError, RecursionError) as e:
        raise ValueError(f"{path}: cannot read the GGUF header ({e}).") from e


def _count_elements(m) -> int:
    if m[:4] != _MAGIC:
        raise ValueError(f"no GGUF magic (found {bytes(m[:4])!r})")
    # Version 0 in the low half: written for the other byte order.
    order = ">" if struct.unpack_from("<I", m, 4)[0] & 0xFFFF == 0 else "<"
    u32, u64 = struct.Struct(order + "I"), struct.Struct(order + "Q")
    tensors, entries = struct.unpack_from(order + "QQ", m, 8)
    size = len(m)
    _check_count(tensors, _MIN_TENSOR_ENTRY, 24, size, "the tensor count")
    _check_count(entries, _MIN_METADATA_ENTRY, 24, size, "the metadata count")

    def skip_value(offset: int, value_type: int) -> int:
        if value_type in _SCALAR_BYTES:
            return offset + _SCALAR_BYTES[value_type]
        if value_type == _STRING:
            return offset + 8 + u64.unpack_from(m, offset)[0]
        if value_type != _ARRAY:
            raise ValueError(f"unknown metadata value type {value_type} at byte {offset}")
        item_type, count = u32.unpack_from(m, offset)[0], u64.unpack_from(m, offset + 4)[0]
        offset += 12
        if item_type in _SCALAR_BYTES:
            return offset + count * _SCALAR_BYTES[item_type]
        for _ in range(count):
            offset = skip_value(offset, item_type)
            if offset > size:
                raise ValueError("a metadata array runs past the end of the file")
        return offset

    offset = 24
    for _ in range(entries):
        offset += 8 + u64.unpack_from(m, offset)[0]
        value_type = u32.unpack_from(m, offset)[0]
        offset = skip_value(offset + 4, value_type)
    total = 0
    for _ in range(tensors):
        offset += 8 + u64.unpack_from(m, offset)[0]
        dims = u32.unpack_from(m, offset)[0]
        shape = struct.unpack_from(f"{order}{dims}Q", m, offset + 4)
        offset += 4 + 8 * dims + 4 + 8
        n = 1
        for d in shape:
            n *= d
        total += n
    if offset > size:
        raise ValueError("the tensor list runs past the end of the file")
    return total
