"""Bad GGUF files are refused with a ValueError naming the file and the fault, before anything
is allocated: truncated files, a flipped magic, wrong tensor counts and offsets, and tensor
types pagedlm cannot run."""
from __future__ import annotations

import re
import struct

import numpy as np
import pytest

from pagedlm.model_executor.model_loader.gguf_file import (check_runnable_types,
                                                         gguf_element_count, open_gguf)
from pagedlm.model_executor.model_loader.gguf_header import read_gguf_header

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
# Header: magic (4), version (4), tensor count (8, at byte 8), metadata count (8).
_TENSOR_COUNT_AT = 8


def _write(path, extra=()):
    """A small valid file: metadata with a string array, one Q8_0 and two F32 tensors."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_token_list(["a", "b", "<s>"])
    rng = np.random.default_rng(0)
    q = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), Q.Q8_0)
    writer.add_tensor("blk.0.attn_q.weight", q, raw_dtype=Q.Q8_0)
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(64, dtype=np.float32))
    for name, data, qtype in extra:
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def good(tmp_path):
    return _write(tmp_path / "good.gguf")


def _refused(path, *patterns):
    """Both readers refuse the file alike: gguf's full one and the load path's header walk."""
    for reader in (open_gguf, read_gguf_header):
        with pytest.raises(ValueError) as info:
            reader(path)
        message = str(info.value)
        assert message.startswith(str(path)), message
        for pattern in patterns:
            assert re.search(pattern, message), message
    return message


def test_valid_file_opens(good):
    reader = open_gguf(good)
    assert [t.name for t in reader.tensors] == [
        "blk.0.attn_q.weight", "blk.0.attn_norm.weight", "output_norm.weight"]
    np.testing.assert_array_equal(reader.tensors[2].data, np.ones(64, dtype=np.float32))
    check_runnable_types(reader, {"q8_0", "f32"})
    header = read_gguf_header(good)
    assert [(t.name, t.tensor_type, t.shape.tolist(), t.data_offset, t.n_bytes)
            for t in header.tensors] == [(t.name, t.tensor_type, t.shape.tolist(),
                                          t.data_offset, t.n_bytes) for t in reader.tensors]
    for mine, theirs in zip(header.tensors, reader.tensors):
        np.testing.assert_array_equal(mine.data, theirs.data)
    assert header.value("general.architecture") == "llama"
    assert header.value("llama.block_count") == 1
    assert header.value("tokenizer.ggml.tokens") == ["a", "b", "<s>"]
    assert header.value("absent", 7) == 7
    check_runnable_types(header, {"q8_0", "f32"})


@pytest.mark.parametrize("keep", [0, 10, 40, 200, -100, -1])
def test_truncated_file(good, keep):
    data = good.read_bytes()
    good.write_bytes(data[:keep] if keep >= 0 else data[:len(data) + keep])
    if keep == 0:
        _refused(good, "truncated GGUF file: 0 bytes")
    elif keep == 10:
        _refused(good, "truncated GGUF file: 10 bytes")
    elif keep > 0:  # inside the metadata or the tensor list
        _refused(good, "truncated or corrupt", "past its end|left after byte")
    else:  # inside the tensor data: the last tensor runs past the end
        _refused(good, "'output_norm.weight'", r"needs bytes \[\d+, \d+\) but the file has",
                 "truncated")


def test_flipped_magic(good):
    data = bytearray(good.read_bytes())
    data[0] ^= 0xFF
    good.write_bytes(bytes(data))
    _refused(good, "not a GGUF file", "magic b'GGUF'")


def test_missing_file(tmp_path):
    _refused(tmp_path / "absent.gguf", "cannot read")


@pytest.mark.parametrize("delta", [-1, -2, 1, 2, 1 << 40])
def test_wrong_tensor_count(good, delta):
    data = bytearray(good.read_bytes())
    (count,) = struct.unpack_from("<Q", data, _TENSOR_COUNT_AT)
    assert count == 3
    struct.pack_into("<Q", data, _TENSOR_COUNT_AT, count + delta)
    good.write_bytes(bytes(data))
    if delta == 1 << 40:
        _refused(good, "tensor count says 1099511627779 entries")
    elif delta < 0:
        # The data section would start where the last tensor entries are: refused, not read.
        _refused(good, "belong to no tensor", "wrong tensor count")
    else:
        _refused(good, "corrupt")


def test_tensor_offset_past_the_end(good):
    reader = open_gguf(good)
    field = reader.tensors[2].field
    offset_at = field.offset + sum(int(p.nbytes) for p in field.parts[:-1])
    data = bytearray(good.read_bytes())
    struct.pack_into("<Q", data, offset_at, len(data))
    del reader
    good.write_bytes(bytes(data))
    _refused(good, "'output_norm.weight' \\(F32, shape \\[64\\]\\) needs bytes")


def test_unsupported_type_names_tensor_type_and_list(tmp_path):
    block, block_bytes = gguf.GGML_QUANT_SIZES[Q.IQ2_XXS]
    raw = np.zeros((2, 256 // block * block_bytes), dtype=np.uint8)
    path = _write(tmp_path / "iq.gguf", [("blk.0.ffn_down.weight", raw, Q.IQ2_XXS)])
    for reader in (open_gguf(path), read_gguf_header(path)):  # a valid file: only the type
        with pytest.raises(ValueError) as info:                 # is refused
            check_runnable_types(reader, {"F32", "q8_0", "Q4_K"})
        message = str(info.value)
        assert message.startswith(str(path)), message
        assert "IQ2_XXS" in message and "'blk.0.ffn_down.weight'" in message, message
        assert "supported types: F32, Q4_K, Q8_0" in message, message


def test_element_count_from_the_header_alone(good):
    assert gguf_element_count(good) == sum(int(t.n_elements) for t in open_gguf(good).tensors)
    data = good.read_bytes()
    good.write_bytes(data[:150])  # inside the tensor list
    with pytest.raises(ValueError, match=f"{good}: cannot read the GGUF header"):
        gguf_element_count(good)


def test_metadata_nested_too_deeply(tmp_path):
    """An array of arrays 5000 deep (60 KB) raised a bare RecursionError from both readers."""
    inner = struct.pack("<IQ", int(gguf.GGUFValueType.UINT8), 0)
    for _ in range(5000):
        inner = struct.pack("<IQ", int(gguf.GGUFValueType.ARRAY), 1) + inner
    key = b"evil.nested"
    path = tmp_path / "nested.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
                     + struct.pack("<I", int(gguf.GGUFValueType.ARRAY)) + inner)
    _refused(path, "nested too deeply")
    with pytest.raises(ValueError, match="cannot read the GGUF header"):
        gguf_element_count(path)
