"""Convert a GGUF file into a HuggingFace-format model directory.

Architectures: llama, qwen2, qwen3, phi3, qwen2moe, qwen3moe, gemma2, gemma3 and gpt2.

The metadata (config.json, generation_config.json, tokenizer files) is written for every GGUF
model, so the rest of pagedlm reads configs and tokenizers from an HF directory; the weights
dequantized to float32 (model.safetensors, which ``transformers.AutoModelForCausalLM`` loads) only
when the float path runs. With ``quantization="gguf"`` the weights come from the file itself
(gguf_weights.py).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

import numpy as np
import torch
from gguf import MODEL_ARCH_NAMES, get_tensor_name_map
from gguf.quants import dequantize
from safetensors.torch import save_file
from transformers import GenerationConfig, PretrainedConfig, PreTrainedTokenizerFast
from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

from pagedlm.model_executor.model_loader.gguf_header import GGUFHeader, read_gguf_header
from pagedlm.model_executor.model_loader.gguf_processors import tensor_processor

if TYPE_CHECKING:
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor


@dataclass(frozen=True)
class _ArchSpec:
    """How one GGUF ``general.architecture`` becomes a transformers config and state dict.

    Tensor names come from gguf's own TensorNameMap applied to the transformers model's
    parameter names (as transformers' GGUF loader does); the config keys from transformers'
    GGUF_CONFIG_MAPPING; the per-tensor undoing of llama.cpp's converter from transformers'
    GGUF tensor processors (gguf_processors.py). Only what those leave open is spelled out here.
    """

    architecture: str  # the HF `architectures` entry, i.e. pagedlm's registry key
    # transformers' model_type, where it is not the GGUF architecture's name.
    model_type: str | None = None
    # HF ties every bias of a group to one config switch: (switch, projection names).
    bias_switches: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # Config fields whose value is the size of a tensor: field -> (gguf tensor, axis).
    sized_by: tuple[tuple[str, str, int], ...] = ()
    # GGUF metadata keys (without the architecture prefix) -> config fields that transformers'
    # mapping lacks or names differently.
    config_keys: tuple[tuple[str, str], ...] = ()


_LLAMA_BIASES = (
    ("attention_bias", ("attn_q", "attn_k", "attn_v", "attn_output")),
    ("mlp_bias", ("ffn_gate", "ffn_up", "ffn_down")),
)
# transformers' GGUF mapping leaves these at the config's defaults; llama.cpp writes them.
_GEMMA_SOFTCAPS = (
    ("attn_logit_softcapping", "attn_logit_softcapping"),
    ("final_logit_softcapping", "final_logit_softcapping"),
)
# Only architectures whose config transformers builds and that pagedlm's registry runs or
# refuses by name: Qwen3's, the MoE models' and Gemma's classes are not in the registry on
# this branch, so a converted directory of theirs is refused there with the list of supported
# architectures.
_ARCHITECTURES = MappingProxyType({
    "llama": _ArchSpec("LlamaForCausalLM", bias_switches=_LLAMA_BIASES),
    "qwen2": _ArchSpec("Qwen2ForCausalLM"),
    "qwen3": _ArchSpec("Qwen3ForCausalLM"),
    "phi3": _ArchSpec("Phi3ForCausalLM"),
    "qwen2moe": _ArchSpec(
        "Qwen2MoeForCausalLM",
        model_type="qwen2_moe",
        config_keys=(
            ("expert_feed_forward_length", "moe_intermediate_size"),
            ("expert_shared_feed_forward_length", "shared_expert_intermediate_size"),
        ),
    ),
    "qwen3moe": _ArchSpec(
        "Qwen3MoeForCausalLM",
        model_type="qwen3_moe",
        config_keys=(("expert_feed_forward_length", "moe_intermediate_size"),),
    ),
    "gemma2": _ArchSpec("Gemma2ForCausalLM", config_keys=_GEMMA_SOFTCAPS),
    "gemma3": _ArchSpec("Gemma3ForCausalLM", model_type="gemma3_text", config_keys=_GEMMA_SOFTCAPS),
    "gpt2": _ArchSpec(
        "GPT2LMHeadModel",
        sized_by=(("n_positions", "position_embd.weight", 0),),
        config_keys=(("feed_forward_length", "n_inner"),),
    ),
})
SUPPORTED_ARCHITECTURES = tuple(_ARCHITECTURES)
# In a GGUF model's metadata directory: the HF parameter names of its architecture and config.
HF_NAMES_FILE = "pagedlm-hf-names.json"
# Per-dimension llama3 rope factors; turned into config.rope_parameters, not a weight.
_ROPE_FREQS = "rope_freqs.weight"


def convert_gguf(gguf_path: str, out_dir: str) -> None:
    """Write an HF-format model directory for ``gguf_path`` into ``out_dir``: the metadata
    (:func:`convert_gguf_metadata`) and the weights dequantized to float32."""
    convert_gguf_metadata(gguf_path, out_dir)
    # The name model_path.FLOAT_WEIGHTS_FILE (that module imports this one).
    write_float_weights(gguf_path, os.path.join(out_dir, "model.safetensors"))


def open_architecture(gguf_path: str, header: GGUFHeader | None = None):
    """(header, architecture, its spec) of a GGUF file; ValueError for one pagedlm cannot read.
    header: the file's header if already read."""
    gguf_path = os.fspath(gguf_path)
    reader = header if header is not None else read_gguf_header(gguf_path)
    arch = _metadata(reader, "general.architecture")
    spec = _ARCHITECTURES.get(arch)
    if spec is None:
        raise ValueError(
            f"{gguf_path}: GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})."
        )
    return reader, arch, spec


def write_float_weights(gguf_path: str, out_file: str) -> None:
    """Every weight of the file dequantized to float32, under its HF name, in ``out_file``."""
    reader, arch, spec = open_architecture(gguf_path)
    tensors, config, hf_names, processor, gguf_to_hf = open_model_tensors(reader, arch, spec)
    state_dict = float_state_dict(tensors.values(), processor, gguf_to_hf, spec)
    add_zero_biases(state_dict, hf_names, {n: t.shape[0] for n, t in state_dict.items()})
    missing = sorted(hf_names - state_dict.keys() - _tied_names(config, hf_names))
    if missing:
        raise ValueError(f"{gguf_path}: GGUF file lacks tensors for {', '.join(missing)}.")
    save_file(state_dict, out_file, metadata={"format": "pt"})


def float_state_dict(tensors, processor: TensorProcessor, gguf_to_hf: dict[str, str],
                     spec: _ArchSpec) -> dict[str, torch.Tensor]:
    """The given GGUF tensors dequantized to float32 with llama.cpp's layout undone, under
    their HF names (processors may merge several, e.g. MoE experts, into one)."""
    state_dict: dict[str, torch.Tensor] = {}
    for tensor in tensors:
        name = tensor.name
        if name == _ROPE_FREQS:
            continue  # already folded into config.rope_parameters
        # Stacked experts map without their ".weight": HF holds them as bare parameters.
        if name not in gguf_to_hf and name.rpartition(".")[0] not in gguf_to_hf:
            raise ValueError(f"GGUF tensor {name!r} has no known HuggingFace "
                             f"{spec.architecture} equivalent.")
        values = dequantize(tensor.data, tensor.tensor_type).reshape(_gguf_shape(tensor))
        # Processors that store a tensor themselves (GPT-2's output.weight under lm_head.weight,
        # MoE experts merged into gate_up_proj) say so with name None; the others return the
        # tensor with its llama.cpp layout undone.
        processed = processor.process(
            weights=values, name=name, tensor_key_mapping=gguf_to_hf,
            parsed_parameters={"tensors": state_dict}
        )
        if processed.name is None:
            continue
        values = processed.weights
        # np.array copies: the data may be a read-only view into the memory-mapped file.
        # order="C": undoing a transposed layout (GPT-2) leaves a view safetensors cannot save.
        state_dict[gguf_to_hf[name]] = torch.from_numpy(
            np.array(values, dtype=np.float32, order="C"))
    return state_dict


def add_zero_biases(state_dict: dict, hf_names: set[str], rows: dict[str, int]) -> None:
    """An absent bias is no bias; HF's one switch per group needs the rest as zeros. rows: the
    output rows of each weight the file has (float or in blocks)."""
    for name in hf_names - state_dict.keys():
        weight = name.removesuffix(".bias") + ".weight"
        if name.endswith(".bias") and weight in rows:
            state_dict[name] = torch.zeros(rows[weight])


def convert_gguf_metadata(gguf_path: str, out_dir: str) -> None:
    """Write the small part of an HF-format directory for ``gguf_path`` into ``out_dir``:
    config.json, generation_config.json and the tokenizer files (no weights)."""
    reader, arch, spec = open_architecture(gguf_path)
    config = _hf_config(reader, arch, spec, {t.name: t for t in reader.tensors})
    os.makedirs(out_dir, exist_ok=True)
    config.save_pretrained(out_dir)
    # Found once here: a quantized load then need not import transformers' model class and
    # build it on the meta device, which left ~90 MiB in the process (1B Llama file).
    with open(os.path.join(out_dir, HF_NAMES_FILE), "w") as f:
        json.dump(sorted(_hf_parameter_names(config)), f)

    # Chat models stop on end-of-turn tokens too (llama.cpp treats them all as end of generation).
    stop_ids = [getattr(config, "eos_token_id", None)]
    stop_ids += [_metadata(reader, f"tokenizer.ggml.{key}")
                 for key in ("eot_token_id", "eom_token_id")]
    stop_ids = list(dict.fromkeys(int(i) for i in stop_ids if i is not None))
    generation_config = GenerationConfig(
        bos_token_id=getattr(config, "bos_token_id", None),
        eos_token_id=stop_ids[0] if len(stop_ids) == 1 else (stop_ids or None),
        pad_token_id=getattr(config, "pad_token_id", None),
    )
    generation_config.save_pretrained(out_dir)

    # AutoTokenizer resolves these to this same class, but first re-parses the whole GGUF
    # with gguf's slow per-string reader just to build a config (~4 s for this vocabulary).
    tokenizer = PreTrainedTokenizerFast.from_pretrained(
        os.path.dirname(os.path.abspath(gguf_path)), gguf_file=os.path.basename(gguf_path)
    )
    tokenizer.save_pretrained(out_dir)


def open_model_tensors(reader: GGUFHeader, arch: str, spec: _ArchSpec,
                       hf_names: set[str] | None = None, config: PretrainedConfig | None = None):
    """(tensors by name, HF config, HF parameter names, tensor processor, GGUF -> HF names).
    hf_names: the parameter names if known (HF_NAMES_FILE), else found from transformers'
    model class; config: the file's HF config if known (its metadata directory's resolved
    config), else built from the header."""
    tensors = {t.name: t for t in reader.tensors}
    if config is None:
        config = _hf_config(reader, arch, spec, tensors)
    if hf_names is None:
        hf_names = _hf_parameter_names(config)
    processor = tensor_processor(arch, config.to_dict())
    gguf_to_hf = _gguf_to_hf_names(arch, config.num_hidden_layers, hf_names, processor)
    return tensors, config, hf_names, processor, gguf_to_hf


def _hf_config(reader: GGUFHeader, arch: str, spec: _ArchSpec, tensors: dict) -> PretrainedConfig:
    def hparam(key: str, default=None):
        return _metadata(reader, f"{arch}.{key}", default)

    kwargs = {}
    # transformers keys its GGUF config table by the GGUF name or, for MoE, by its model_type.
    mapping = GGUF_CONFIG_MAPPING.get(arch) or GGUF_CONFIG_MAPPING[spec.model_type]
    for key, field in {**mapping, **dict(spec.config_keys)}.items():
        value = hparam(key)
        if field is not None and value is not None:
            kwargs[field] = value
    kwargs.update(GGUF_CONFIG_DEFAULTS_MAPPING.get(spec.model_type or arch, {}))
    # Imported here: it imports the transformers.models package (about 1 s), which a load
    # whose metadata directory has the resolved config never needs.
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    config_class = CONFIG_MAPPING[spec.model_type or arch]
    probe = config_class()

    _check_hparams(reader, arch, tensors)
    num_heads = int(hparam("attention.head_count"))
    hidden_size = int(hparam("embedding_length"))
    if "head_dim" in probe.to_dict():
        # llama.cpp writes key_length where head_dim is not hidden / heads; transformers reads
        # llama's from rope.dimension_count, which is the same number there.
        kwargs["head_dim"] = int(hparam("attention.key_length",
                                        kwargs.get("head_dim", hidden_size // num_heads)))
    head_dim = kwargs.get("head_dim", hidden_size // num_heads)
    rope_dims = hparam("rope.dimension_count")
    rope_theta = kwargs.pop("rope_theta", None)
    default_rope = probe.to_dict().get("rope_parameters")
    if default_rope is not None:
        rope_parameters = {"rope_type": "default", "rope_theta": float(rope_theta or 10000.0)}
        rope_freqs = tensors.get(_ROPE_FREQS)
        if rope_freqs is not None:
            rope_freqs = dequantize(rope_freqs.data, rope_freqs.tensor_type)
        rope_parameters.update(_rope_scaling(reader, arch, rope_freqs,
                                             rope_parameters["rope_theta"], head_dim))
        if rope_dims is not None and int(rope_dims) != head_dim:
            rope_parameters["partial_rotary_factor"] = int(rope_dims) / head_dim
        if "rope_type" not in default_rope:
            # One rope per layer type (Gemma 3): GGUF's base and scaling are the global layers';
            # llama.cpp hard-codes the local layers' base, as the config's default does.
            rope_parameters = {**default_rope, "full_attention": rope_parameters}
        kwargs["rope_parameters"] = rope_parameters

    token_ids = {
        f"{name}_token_id": _metadata(reader, f"tokenizer.ggml.{key}")
        for name, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"),
                          ("pad", "padding_token_id"))
    }
    # None where the file has none: some config classes default to ids of their own
    # vocabulary (Phi-3's pad 32000), which would be out of range here.
    kwargs.update({k: None if v is None else int(v) for k, v in token_ids.items()})
    for switch, kinds in spec.bias_switches:
        kwargs[switch] = any(_block_kind(name) in kinds and name.endswith(".bias")
                             for name in tensors)
    for field, name, axis in spec.sized_by:
        kwargs[field] = _gguf_shape(tensors[name])[axis]
    kwargs.update(
        architectures=[spec.architecture],
        # The embedding's row count is what the weights need; metadata may omit vocab_size.
        vocab_size=_gguf_shape(tensors["token_embd.weight"])[0],
        # Without an output matrix llama.cpp reuses the embedding, i.e. tied weights.
        tie_word_embeddings="output.weight" not in tensors,
        dtype="float32",
    )
    return config_class(**kwargs)


def _check_hparams(reader: GGUFHeader, arch: str, tensors: dict) -> None:
    """The sizes the config is built from, against the file's own tensors, before anything is
    built from them: a block_count of 10**9 built that many layers on the meta device (the
    load hung, its memory growing past 4 GB), and a missing or zero head count surfaced as a
    TypeError or ZeroDivisionError from deep inside."""
    def value(key: str, required: bool = False) -> int | None:
        v = _metadata(reader, f"{arch}.{key}")
        if v is None:
            if required:
                raise ValueError(f"{arch}.{key}: missing from the file's metadata.")
            return None
        if isinstance(v, (list, tuple, np.ndarray)) and not required:
            return None  # per-layer sizes: the config class takes them as they are
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{arch}.{key} must be a positive integer, got {v!r}.")
        return int(v)

    layers = {int(n.split(".")[1]) for n in tensors
              if n.startswith("blk.") and n.split(".")[1].isdigit()}
    blocks = value("block_count", required=True)
    if blocks > len(layers):
        raise ValueError(f"{arch}.block_count is {blocks}, but the file's tensors hold "
                         f"{len(layers)} layers.")
    if "token_embd.weight" not in tensors:
        raise ValueError("the file has no token_embd.weight tensor (the token embedding).")

    def shape(name: str, dims: int) -> tuple[int, ...] | None:
        if name not in tensors:
            return None
        got = _gguf_shape(tensors[name])
        if len(got) != dims:
            raise ValueError(f"{name} has {len(got)} dimensions, not {dims}.")
        return got

    hidden = value("embedding_length", required=True)
    width = shape("token_embd.weight", 2)[-1]
    if hidden != width:
        raise ValueError(f"{arch}.embedding_length is {hidden}, but token_embd.weight is "
                         f"{width} wide.")
    heads = value("attention.head_count", required=True)
    kv_heads = value("attention.head_count_kv")
    if kv_heads is not None and heads % kv_heads:
        raise ValueError(f"{arch}.attention.head_count_kv ({kv_heads}) must divide "
                         f"{arch}.attention.head_count ({heads}).")
    head_dim = value("attention.key_length") or hidden // heads
    if head_dim < 1:
        raise ValueError(f"{arch}.attention.head_count ({heads}) is larger than "
                         f"{arch}.embedding_length ({hidden}).")
    q = shape("blk.0.attn_q.weight", 2)
    if q is not None and q[0] != heads * head_dim:
        raise ValueError(f"blk.0.attn_q.weight has {q[0]} rows, not "
                         f"{arch}.attention.head_count x the head size ({heads} x {head_dim}).")
    rope_dims = value("rope.dimension_count")
    if rope_dims is not None and (rope_dims > head_dim or rope_dims % 2):
        raise ValueError(f"{arch}.rope.dimension_count ({rope_dims}) must be even and at most "
                         f"the head size ({head_dim}).")
    for key, name, dims, axis, fused in (
            ("feed_forward_length", "blk.0.ffn_up.weight", 2, 0, True),
            ("expert_count", "blk.0.ffn_gate_inp.weight", 2, 0, False),
            ("expert_feed_forward_length", "blk.0.ffn_up_exps.weight", 3, 1, False),
            ("expert_shared_feed_forward_length", "blk.0.ffn_up_shexp.weight", 2, 0, False)):
        size, got = value(key), shape(name, dims)
        # Twice the rows where the up matrix holds the gate's too (Phi-3).
        if size is not None and got is not None and got[axis] not in (
                (size, 2 * size) if fused else (size,)):
            raise ValueError(f"{arch}.{key} is {size}, but {name} is {got[axis]} along its "
                             f"dimension {axis} (shape {got}).")


def _gguf_shape(tensor) -> tuple[int, ...]:
    # ggml lists dimensions fastest-varying first; torch wants them the other way round.
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def _block_kind(gguf_name: str) -> str | None:
    parts = gguf_name.split(".")
    return parts[2] if len(parts) == 4 and parts[0] == "blk" else None


def _hf_parameter_names(config: PretrainedConfig) -> set[str]:
    """The state-dict names transformers' model for ``config`` has, built without memory."""
    # Imported here, at conversion: it imports the transformers.models package (about 1 s),
    # which a quantized load reading the names from HF_NAMES_FILE never needs.
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return set(model.state_dict())


def _tied_names(config: PretrainedConfig, hf_names: set[str]) -> set[str]:
    return {"lm_head.weight"} & hf_names if config.tie_word_embeddings else set()


def _gguf_to_hf_names(arch: str, num_layers: int, hf_names: set[str],
                      processor: TensorProcessor) -> dict[str, str]:
    # transformers' get_gguf_hf_weights_map, without rebuilding the name map per submodule.
    name_map = get_tensor_name_map(_GGUF_ARCH_IDS[arch], num_layers)
    mapping = {}
    for hf_name in hf_names:
        hf_name = processor.preprocess_name(hf_name)
        module, suffix = hf_name, ""
        if hf_name.endswith((".weight", ".bias")):
            module, dot, suffix = hf_name.rpartition(".")
            suffix = dot + suffix
        gguf_name = name_map.get_name(module)
        if gguf_name is None:
            # One HF tensor fed by several GGUF ones (MoE gate and up experts).
            processor.perform_fallback_tensor_mapping(mapping, suffix, "", hf_name)
        else:
            mapping[gguf_name + suffix] = hf_name
    return mapping


_GGUF_ARCH_IDS = MappingProxyType({name: arch for arch, name in MODEL_ARCH_NAMES.items()})


def _metadata(reader: GGUFHeader, key: str, default=None):
    return reader.value(key, default)


def _rope_scaling(reader: GGUFHeader, arch: str, rope_freqs, rope_theta: float,
                  head_dim: int) -> dict:
    scaling_type = _metadata(reader, f"{arch}.rope.scaling.type", "none")
    if rope_freqs is not None:
        return _llama3_rope_parameters(np.asarray(rope_freqs, dtype=np.float64).reshape(-1),
                                       rope_theta, head_dim)
    if scaling_type == "none":
        return {}
    if scaling_type == "linear":
        return {"rope_type": "linear",
                "factor": float(_metadata(reader, f"{arch}.rope.scaling.factor"))}
    raise ValueError(f"GGUF rope scaling type {scaling_type!r} is not supported "
                     "(only linear and llama3).")


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


def _llama3_factors(wavelengths: np.ndarray, factor: float, low: float, high: float,
                    original: int) -> np.ndarray:
    # The same formula llama.cpp's converter evaluates to produce rope_freqs.
    smooth = (original / wavelengths - low) / (high - low)
    ramp = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelengths < original / high, 1.0,
                    np.where(wavelengths > original / low, factor, ramp))
