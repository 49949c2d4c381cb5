"""Convert a llama-family GGUF file into a HuggingFace-format model directory.

The result (config.json, model.safetensors in float32, tokenizer files,
generation_config.json) loads with ``transformers.AutoModelForCausalLM`` and
``AutoTokenizer``, so the rest of pagedlm only ever deals with HF directories.
"""

from __future__ import annotations

import math
import os
import re

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file
from transformers import GenerationConfig, LlamaConfig, PreTrainedTokenizerFast

SUPPORTED_ARCHITECTURES = ("llama",)

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_BLOCK_TENSOR_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Per-dimension llama3 rope factors; turned into config.rope_parameters, not a weight.
_ROPE_FREQS = "rope_freqs.weight"


class _PlainArrayGGUFReader(GGUFReader):
    """GGUFReader over a plain ndarray view of its memory map instead of the np.memmap itself.

    Every slice of an np.memmap runs memmap.__array_finalize__ in Python. GGUFReader slices
    once per metadata string (~100k for a 49k-token vocabulary plus merges) and the
    dequantizers slice each tensor into many row groups, which made reading ~4x and
    dequantizing ~2x slower. The view shares the same mapped pages and keeps the map alive.
    """

    @property
    def data(self) -> np.ndarray:
        return self._plain_data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain_data = value.view(np.ndarray)


def convert_gguf(gguf_path: str, out_dir: str) -> None:
    """Write an HF-format llama model directory for ``gguf_path`` into ``out_dir``."""
    gguf_path = os.fspath(gguf_path)
    reader = _PlainArrayGGUFReader(gguf_path)
    arch = _metadata(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{gguf_path}: GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})."
        )

    def hparam(key: str, default=None):
        return _metadata(reader, f"{arch}.{key}", default)

    hidden_size = int(hparam("embedding_length"))
    num_heads = int(hparam("attention.head_count"))
    num_kv_heads = int(hparam("attention.head_count_kv", num_heads))
    head_dim = int(hparam("attention.key_length", hparam("rope.dimension_count", hidden_size // num_heads)))
    rope_theta = float(hparam("rope.freq_base", 10000.0))

    state_dict: dict[str, torch.Tensor] = {}
    rope_freqs = None
    for tensor in reader.tensors:
        # ggml lists dimensions fastest-varying first; torch wants them the other way round.
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        values = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        if tensor.name == _ROPE_FREQS:
            rope_freqs = values
            continue
        name = _hf_name(tensor.name)
        if ".self_attn.q_proj." in name:
            values = _unpermute_rope(values, num_heads)
        elif ".self_attn.k_proj." in name:
            values = _unpermute_rope(values, num_kv_heads)
        # np.array copies: the data may be a read-only view into the memory-mapped file.
        state_dict[name] = torch.from_numpy(np.array(values, dtype=np.float32))

    num_layers = int(hparam("block_count"))
    attention_bias = _fill_missing_biases(state_dict, num_layers, ("q_proj", "k_proj", "v_proj", "o_proj"))
    mlp_bias = _fill_missing_biases(state_dict, num_layers, ("gate_proj", "up_proj", "down_proj"))
    # Without an output matrix llama.cpp reuses the embedding, i.e. tied weights.
    tie_word_embeddings = "lm_head.weight" not in state_dict

    rope_parameters = {"rope_type": "default", "rope_theta": rope_theta}
    rope_parameters.update(_rope_scaling(reader, arch, rope_freqs, rope_theta, head_dim))

    token_ids = {
        f"{name}_token_id": _metadata(reader, f"tokenizer.ggml.{key}")
        for name, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("pad", "padding_token_id"))
    }
    token_ids = {k: int(v) for k, v in token_ids.items() if v is not None}

    config = LlamaConfig(
        architectures=["LlamaForCausalLM"],
        # The embedding's row count is what the weights need; metadata may omit vocab_size.
        vocab_size=state_dict["model.embed_tokens.weight"].shape[0],
        hidden_size=hidden_size,
        intermediate_size=int(hparam("feed_forward_length")),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=int(hparam("context_length", 2048)),
        rms_norm_eps=float(hparam("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_parameters=rope_parameters,
        attention_bias=attention_bias,
        mlp_bias=mlp_bias,
        tie_word_embeddings=tie_word_embeddings,
        dtype="float32",
        **token_ids,
    )
    os.makedirs(out_dir, exist_ok=True)
    config.save_pretrained(out_dir)
    save_file(state_dict, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})

    # Chat models stop on end-of-turn tokens too (llama.cpp treats them all as end of generation).
    stop_ids = [token_ids.get("eos_token_id")]
    stop_ids += [_metadata(reader, f"tokenizer.ggml.{key}") for key in ("eot_token_id", "eom_token_id")]
    stop_ids = list(dict.fromkeys(int(i) for i in stop_ids if i is not None))
    generation_config = GenerationConfig(
        bos_token_id=token_ids.get("bos_token_id"),
        eos_token_id=stop_ids[0] if len(stop_ids) == 1 else (stop_ids or None),
        pad_token_id=token_ids.get("pad_token_id"),
    )
    generation_config.save_pretrained(out_dir)

    # AutoTokenizer resolves llama to this same class, but first re-parses the whole GGUF
    # with gguf's slow per-string reader just to build a config (~4 s for this vocabulary).
    tokenizer = PreTrainedTokenizerFast.from_pretrained(
        os.path.dirname(os.path.abspath(gguf_path)), gguf_file=os.path.basename(gguf_path)
    )
    tokenizer.save_pretrained(out_dir)


def _metadata(reader: GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _BLOCK_TENSOR_RE.fullmatch(gguf_name)
    if match and match.group(2) in _BLOCK_TENSORS:
        layer, kind, suffix = match.groups()
        return f"model.layers.{layer}.{_BLOCK_TENSORS[kind]}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no known HuggingFace llama equivalent.")


def _unpermute_rope(values: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's converter interleaves each head's two rotary halves for its rope kernel:
    #   w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2).reshape(w.shape)
    # Swapping the same two axes of the opposite split undoes it (weights and biases alike).
    rows = values.shape[0]
    split = values.reshape(n_head, rows // n_head // 2, 2, *values.shape[1:])
    return split.swapaxes(1, 2).reshape(values.shape)


def _fill_missing_biases(state_dict: dict[str, torch.Tensor], num_layers: int, projections: tuple[str, ...]) -> bool:
    """HF's llama has one switch for all attention (or MLP) biases, so absent ones become zeros."""
    module = "self_attn" if "q_proj" in projections else "mlp"
    names = [f"model.layers.{i}.{module}.{p}" for i in range(num_layers) for p in projections]
    if not any(f"{n}.bias" in state_dict for n in names):
        return False
    for n in names:
        state_dict.setdefault(f"{n}.bias", torch.zeros(state_dict[f"{n}.weight"].shape[0]))
    return True


def _rope_scaling(reader: GGUFReader, arch: str, rope_freqs, rope_theta: float, head_dim: int) -> dict:
    scaling_type = _metadata(reader, f"{arch}.rope.scaling.type", "none")
    if rope_freqs is not None:
        return _llama3_rope_parameters(np.asarray(rope_freqs, dtype=np.float64).reshape(-1), rope_theta, head_dim)
    if scaling_type == "none":
        return {}
    if scaling_type == "linear":
        return {"rope_type": "linear", "factor": float(_metadata(reader, f"{arch}.rope.scaling.factor"))}
    raise ValueError(f"GGUF rope scaling type {scaling_type!r} is not supported (only linear and llama3).")


def _llama3_rope_parameters(factors: np.ndarray, rope_theta: float, head_dim: int) -> dict:
    """Recover HF's llama3 rope parameters from llama.cpp's per-dimension ``rope_freqs``.

    llama.cpp stores only the wavelength multipliers computed from them. Every Llama 3.x
    release uses low_freq_factor=1 and high_freq_factor=4; with those fixed, the original
    context length follows from any dimension on the smooth ramp between 1 and ``factor``.
    The result is checked by recomputing the multipliers, so a mismatch is an error
    rather than a silently different model.
    """
    wavelengths = 2 * math.pi * rope_theta ** (np.arange(0, head_dim, 2) / head_dim)
    factor = float(factors.max())
    low, high = 1.0, 4.0
    ramp = (factors > 1 + 1e-6) & (factors < factor - 1e-6)
    if factor > 1 and ramp.any():
        i = int(np.argmax(ramp))
        # factors[i] = 1 / ((1 - s) / factor + s), with s = (orig / wavelength - low) / (high - low)
        smooth = (1 / factors[i] - 1 / factor) / (1 - 1 / factor)
        original = int(round(wavelengths[i] * (smooth * (high - low) + low)))
        params = {
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": low,
            "high_freq_factor": high,
            "original_max_position_embeddings": original,
        }
        if len(factors) == len(wavelengths) and np.allclose(
            _llama3_factors(wavelengths, factor, low, high, original), factors, rtol=1e-4
        ):
            return params
    raise ValueError(
        "GGUF rope_freqs.weight does not match llama3 rope scaling with "
        "low_freq_factor=1 and high_freq_factor=4; these rope frequencies are not supported."
    )


def _llama3_factors(wavelengths: np.ndarray, factor: float, low: float, high: float, original: int) -> np.ndarray:
    # The same formula llama.cpp's converter evaluates to produce rope_freqs.
    smooth = (original / wavelengths - low) / (high - low)
    ramp = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelengths < original / high, 1.0, np.where(wavelengths > original / low, factor, ramp))
