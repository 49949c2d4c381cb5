"""A model larger than memory is refused before the load starts, with the figure that counts
for its path (a GGUF file's own size when it stays in its blocks, its float32 copy when it is
converted, the weights in dtype otherwise). The available memory is the check's argument."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from pagedlm.model_executor.model_loader.gguf_file import open_gguf
from pagedlm.model_executor.model_loader.memory_check import check_fits_memory, weight_memory
from pagedlm.model_executor.model_loader.model_path import CONVERSION_MARKER, FLOAT_WEIGHTS_FILE
from tests.models.test_gguf_file import _write

gguf = pytest.importorskip("gguf")


@pytest.fixture
def gguf_model(tmp_path):
    """A GGUF file and a resolved directory naming it as its source (as model_path makes)."""
    path = _write(tmp_path / "m.gguf")
    model_dir = tmp_path / "resolved"
    model_dir.mkdir()
    (model_dir / CONVERSION_MARKER).write_text(json.dumps({"source": str(path)}))
    elements = sum(int(t.n_elements) for t in open_gguf(path).tensors)
    return path, model_dir, elements


def _refused(need, available, *parts, kv=0):
    with pytest.raises(ValueError) as info:
        check_fits_memory(need, available, kv)
    message = str(info.value)
    assert message.startswith(f"{need.source}: the model is larger than memory"), message
    for part in parts:
        assert part in message, message
    return message


def test_gguf_kept_in_blocks_needs_the_file(gguf_model):
    path, model_dir, _ = gguf_model
    need = weight_memory(str(model_dir), "gguf", torch.float32)
    assert need.source == str(path) and need.nbytes == path.stat().st_size
    check_fits_memory(need, need.nbytes)
    _refused(need, need.nbytes - 1, "memory-mapped")
    # An explicit KV-cache budget counts too.
    _refused(need, need.nbytes + 10, "plus the", "KV cache asked for", kv=11)


def test_gguf_float_path_needs_its_float32_copy(gguf_model):
    path, model_dir, elements = gguf_model
    # Not converted yet: the conversion builds the whole float32 copy, whatever dtype is.
    need = weight_memory(str(model_dir), None, torch.bfloat16)
    assert need.nbytes == 4 * elements
    check_fits_memory(need, 4 * elements)
    _refused(need, 4 * elements - 1, "dequantized to float32", "quantization='gguf'")
    # Converted: the weights in dtype.
    save_file({"w": torch.zeros(elements)}, str(model_dir / FLOAT_WEIGHTS_FILE))
    assert weight_memory(str(model_dir), None, torch.bfloat16).nbytes == 2 * elements
    assert weight_memory(str(model_dir), None, torch.float32).nbytes == 4 * elements


def test_safetensors_dir_needs_its_weights_in_dtype(tmp_path):
    save_file({"a": torch.zeros(3, 5, dtype=torch.bfloat16), "b": torch.zeros(7)},
              str(tmp_path / "model-00001.safetensors"), metadata={"format": "pt"})
    save_file({"c": torch.zeros(2, 2, 2)}, str(tmp_path / "model-00002.safetensors"))
    elements = 15 + 7 + 8
    need = weight_memory(str(tmp_path), None, torch.float32)
    assert need.source == str(tmp_path) and need.nbytes == 4 * elements
    _refused(need, 4 * elements - 1, "in float32", "dtype='bfloat16'")
    assert weight_memory(str(tmp_path), None, torch.bfloat16).nbytes == 2 * elements
    assert weight_memory(str(tmp_path), "int8", torch.float32).nbytes == elements


def test_unreadable_safetensors_header(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(np.uint64(1 << 40).tobytes() + b"{}")
    with pytest.raises(ValueError, match="cannot read the safetensors header"):
        weight_memory(str(tmp_path), None, torch.float32)


def test_a_config_with_more_layers_than_the_weights_is_refused(tmp_path, default_model_dir):
    """num_hidden_layers of 10**9 over a 3-layer model's files: the model was built layer by
    layer before any weight was compared, and the load never ended."""
    from pagedlm import LLM
    from tests.conftest import make_tiny_model
    path = make_tiny_model(tmp_path, "llama", default_model_dir)
    config = json.loads((tmp_path / "llama" / "config.json").read_text())
    (tmp_path / "llama" / "config.json").write_text(json.dumps(
        {**config, "num_hidden_layers": 10**9}))
    with pytest.raises(ValueError, match="num_hidden_layers is 1000000000 .* weights hold 3 "
                                         "layers"):
        LLM(model=path, max_model_len=64, num_gpu_blocks_override=16)


def test_a_safetensors_header_that_is_not_an_object_is_named(tmp_path):
    path = tmp_path / "model.safetensors"
    header = b"[1, 2]"
    path.write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(ValueError, match=r"model.safetensors: cannot read the safetensors "
                                         r"header \(the header is a JSON list"):
        weight_memory(str(tmp_path), None, torch.float32)
