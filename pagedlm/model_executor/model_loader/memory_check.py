"""Will the model's weights fit in memory? Answered from file headers, before anything loads
(and, from the same headers, does a folder's config ask for more layers than its weights hold).

A model larger than memory would otherwise be found out by the kernel's OOM killer minutes into
a load, or by a machine swapping to a halt. The figure is what loading holds, by path:
- a GGUF file kept in its blocks (quantization="gguf"): the file, memory-mapped;
- a GGUF file on the float path, converted for the first time: its float32 copy, which the
  conversion builds whole in memory; once converted, the weights in `dtype`;
- a safetensors directory: its weights in `dtype` (int8 / int4: 1 / 0.5 bytes a weight).
"""
from __future__ import annotations

import glob
import json
import os
import re
import struct
from dataclasses import dataclass

import torch

from pagedlm.model_executor.model_loader.model_path import FLOAT_WEIGHTS_FILE, gguf_source
from pagedlm.utils import dtype_name

# Bytes a weight takes once loaded, for the weight-only quantization methods (scales aside).
_QUANTIZED_BYTES = {"int8": 1.0, "int4": 0.5}


@dataclass(frozen=True)
class WeightMemory:
    """What loading a model's weights will hold in memory."""

    source: str  # the file or directory the weights come from
    nbytes: int
    what: str  # how the weights are held, for the error message
    hint: str = ""  # a way to need less, if there is one (a sentence)


def weight_memory(model_dir: str, quantization: str | None, dtype: torch.dtype
                  ) -> WeightMemory:
    """The memory the weights of the (resolved) model in ``model_dir`` will take, loaded with
    ``quantization`` in ``dtype``; reads file headers only."""
    source = gguf_source(model_dir)
    if source is not None:
        return _gguf_memory(model_dir, source, quantization, dtype)
    files = glob.glob(os.path.join(glob.escape(model_dir), "*.safetensors"))
    elements = _safetensors_elements(files)
    per_weight = _QUANTIZED_BYTES.get(quantization, dtype.itemsize)
    hint = ("" if quantization is not None or dtype.itemsize == 2
            else f"With dtype='bfloat16' they take half (about {_gib(elements * 2)}).")
    return WeightMemory(model_dir, int(elements * per_weight),
                        f"{elements / 1e9:.2f}B weights in "
                        f"{quantization or dtype_name(dtype)}", hint)


def check_fits_memory(need: WeightMemory, available_bytes: int, kv_cache_bytes: int = 0
                      ) -> None:
    """ValueError, before the load starts, when the weights (and an explicit KV-cache budget)
    need more than ``available_bytes`` (the caller's figure: MemAvailable in the engine)."""
    if kv_cache_bytes > available_bytes:
        # The KV budget alone is the bad setting: name that field, as the worker's check does.
        raise ValueError(f"kv_cache_memory_bytes: {kv_cache_bytes} bytes for the KV cache, more "
                         f"than the {available_bytes} bytes of memory available")
    total = need.nbytes + kv_cache_bytes
    if total <= available_bytes:
        return
    kv = f" plus the {_gib(kv_cache_bytes)} KV cache asked for" if kv_cache_bytes else ""
    raise ValueError(f"{need.source}: the model is larger than memory: loading it needs about "
                     f"{_gib(need.nbytes)} ({need.what}){kv}, and {_gib(available_bytes)} is "
                     f"available. {need.hint}".rstrip())


def _gguf_memory(model_dir: str, source: str, quantization: str | None, dtype: torch.dtype
                 ) -> WeightMemory:
    file_bytes = os.path.getsize(source)
    if quantization == "gguf":
        return WeightMemory(source, file_bytes, "the file, memory-mapped: the weights stay in "
                            "their blocks")
    hint = (f"With quantization='gguf' they stay in their blocks, memory-mapped (about "
            f"{_gib(file_bytes)}).")
    converted = os.path.join(model_dir, FLOAT_WEIGHTS_FILE)
    if os.path.isfile(converted):
        elements = _safetensors_elements([converted])
        return WeightMemory(source, elements * dtype.itemsize,
                            f"its weights in {dtype_name(dtype)}", hint)
    # Here, not at the top: the gguf package is only needed for GGUF files (a safetensors
    # model runs without it installed).
    from pagedlm.model_executor.model_loader.gguf_file import gguf_element_count
    elements = gguf_element_count(source)
    return WeightMemory(source, elements * 4, "its weights dequantized to float32, the float "
                        "path's one-time conversion", hint)


def check_layer_count(model_dir: str, num_layers: object) -> None:
    """ValueError naming num_hidden_layers where the config asks for more layers than the
    safetensors files hold: the model was built, layer by layer, before any weight was
    compared (10**9 layers: the load never ended)."""
    if not isinstance(num_layers, int):
        return  # the config class's own check names it
    files = glob.glob(os.path.join(glob.escape(model_dir), "*.safetensors"))
    found = {int(m.group(1)) for _, header in _safetensors_headers(files) for name in header
             if (m := _LAYER_INDEX.search(name))}
    if found and num_layers > len(found):
        raise ValueError(f"num_hidden_layers is {num_layers} in {model_dir}'s config.json, but "
                         f"its weights hold {len(found)} layers.")


# A decoder layer's index in a weight's name (model.layers.3.mlp..., transformer.h.3...).
_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)\.")


def _safetensors_headers(files: list[str]):
    """(path, JSON header) of each safetensors file."""
    for path in files:
        try:
            with open(path, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                if length > os.fstat(f.fileno()).st_size - 8:
                    raise ValueError(f"a {length}-byte header is longer than the file")
                header = json.loads(f.read(length))
            if not isinstance(header, dict):
                raise ValueError(f"the header is a JSON {type(header).__name__}, not an object")
        except (OSError, struct.error, ValueError, RecursionError) as e:
            raise ValueError(f"{path}: cannot read the safetensors header ({e}).") from e
        yield path, header


def _safetensors_elements(files: list[str]) -> int:
    """Weights in the safetensors files, from their JSON headers."""
    total = 0
    for path, header in _safetensors_headers(files):
        try:
            for name, entry in header.items():
                if name != "__metadata__":
                    count = 1
                    for d in entry["shape"]:
                        count *= int(d)
                    total += count
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: cannot read the safetensors header ({e}).") from e
    return total


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB"


