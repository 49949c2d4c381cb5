"""GGUF files of architectures other than llama: qwen2, qwen3, qwen2moe, qwen3moe, phi3, gemma2,
gemma3 and gpt2.

Each test builds a tiny random model with transformers' own config and model classes, writes it
as a GGUF file the way llama.cpp's convert_hf_to_gguf.py does (tensor names from the gguf
package's TensorNameMap, llama.cpp's per-architecture layout changes, one Q8_0 tensor), converts
it with pagedlm and checks the result against transformers' own GGUF loading and, where
pagedlm has the model class, pagedlm's greedy tokens against transformers' on the converted
directory.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from pagedlm import LLM, SamplingParams
from pagedlm.model_executor.model_loader.gguf_loader import convert_gguf
from pagedlm.model_executor.model_loader.model_path import float_model_dir
from pagedlm.model_executor.models.registry import supported_architectures

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

LAYERS, HIDDEN = 2, 64
PROMPTS = ["the cat sat on", "Hello, world", "1, 2, 3, 4,", "def f(x):"]
NUM_TOKENS = 16


def _tokens() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return list(bytes_to_unicode().values()) + ["Ġt", "he", "<|endoftext|>", "<|im_end|>"]


VOCAB = len(_tokens())


def _hf_model(arch: str, tied: bool):
    """A random transformers model of ``arch``; its config also says what the GGUF must carry."""
    common = dict(vocab_size=VOCAB, initializer_range=0.3, tie_word_embeddings=tied,
                  bos_token_id=VOCAB - 2, eos_token_id=VOCAB - 1, pad_token_id=VOCAB - 1)
    llama_like = dict(hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      rms_norm_eps=1e-5,
                      rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
    configs = {
        "qwen2": lambda: transformers.Qwen2Config(**llama_like, **common),
        # transformers' GGUF loader keeps Qwen3Config's default head_dim of 128 (it does not
        # read key_length), so only that value lets it be the reference; it is not hidden/heads.
        "qwen3": lambda: transformers.Qwen3Config(**{**llama_like, "num_attention_heads": 2,
                                                      "num_key_value_heads": 1},
                                                  head_dim=128, **common),
        # Expert sizes at the configs' defaults: transformers' GGUF loader does not read them.
        "qwen2moe": lambda: transformers.Qwen2MoeConfig(**llama_like, num_experts=4,
                                                        num_experts_per_tok=2, **common),
        "qwen3moe": lambda: transformers.Qwen3MoeConfig(**llama_like, head_dim=32, num_experts=4,
                                                        num_experts_per_tok=2, norm_topk_prob=True,
                                                        **common),
        "phi3": lambda: transformers.Phi3Config(**llama_like, sliding_window=None, **common),
        # head_dim 32 is not hidden/heads, so key_length matters; the softcaps are Gemma 2's own.
        "gemma2": lambda: transformers.Gemma2Config(**llama_like, head_dim=32, sliding_window=8,
                                                    attn_logit_softcapping=50.0,
                                                    final_logit_softcapping=30.0, **common),
        # 7 layers: Gemma 3's default pattern of five local layers, one global one, a local one.
        # Local layers keep their own rope base, which GGUF does not carry (llama.cpp fixes it
        # at 10000 too); the global layers' base comes from the file.
        "gemma3": lambda: transformers.Gemma3TextConfig(
            **{**llama_like, "num_hidden_layers": 7, "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 50000.0}}},
            head_dim=32, sliding_window=8, **common),
        # transformers' GGUF loader leaves n_positions at GPT2Config's default of 1024.
        "gpt2": lambda: transformers.GPT2Config(n_embd=HIDDEN, n_layer=LAYERS, n_head=4,
                                                n_positions=1024, layer_norm_epsilon=1e-5,
                                                **common),
    }
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(configs[arch]()).eval()


def _llamacpp_layout(arch: str, hf_name: str, value: np.ndarray) -> np.ndarray:
    # convert_hf_to_gguf.py: GPT2Model.modify_tensors transposes HF's Conv1D weights; the other
    # three keep HF's layout (only LlamaModel permutes q/k, which test_model_loading covers).
    if arch == "gpt2" and hf_name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
        return value.T
    # Gemma2Model / Gemma3Model.modify_tensors store RMSNorm's (1 + w) as a plain weight.
    if arch.startswith("gemma") and hf_name.endswith("norm.weight"):
        return value + 1
    return value


def write_gguf(path: Path, arch: str, model) -> Path:
    cfg = model.config
    tied = cfg.tie_word_embeddings
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_embedding_length(HIDDEN)
    if arch == "gpt2":
        writer.add_context_length(cfg.n_positions)
        writer.add_feed_forward_length(4 * HIDDEN)
        writer.add_head_count(cfg.n_head)
        writer.add_layer_norm_eps(cfg.layer_norm_epsilon)
    else:
        writer.add_context_length(cfg.max_position_embeddings)
        writer.add_feed_forward_length(cfg.intermediate_size)
        writer.add_head_count(cfg.num_attention_heads)
        writer.add_head_count_kv(cfg.num_key_value_heads)
        # Gemma 3: per layer type
        rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
        writer.add_rope_freq_base(rope["rope_theta"])
        writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
        head_dim = getattr(cfg, "head_dim", None) or HIDDEN // cfg.num_attention_heads
        writer.add_rope_dimension_count(head_dim)
        if head_dim != HIDDEN // cfg.num_attention_heads:
            writer.add_key_length(head_dim)
            writer.add_value_length(head_dim)
        if arch.startswith("gemma"):
            writer.add_sliding_window(cfg.sliding_window)
        if arch.endswith("moe"):
            writer.add_expert_count(cfg.num_experts)
            writer.add_expert_used_count(cfg.num_experts_per_tok)
            writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if arch == "qwen2moe":
            writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
        if arch == "gemma2":
            writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
            writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(_tokens())
    writer.add_token_merges(["Ġ t", "h e"])
    writer.add_bos_token_id(VOCAB - 2)
    writer.add_eos_token_id(VOCAB - 1)
    writer.add_pad_token_id(VOCAB - 1)

    arch_id = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}[arch]
    name_map = gguf.get_tensor_name_map(arch_id, cfg.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue  # llama.cpp writes no output matrix for tied embeddings
        value = tensor.numpy()
        if hf_name.endswith("experts.gate_up_proj"):
            # convert_hf_to_gguf.py writes HF's fused [experts, 2 * ffn, hidden] as two stacks.
            layer = hf_name.split(".")[2]
            gate, up = np.split(value, 2, axis=1)
            writer.add_tensor(f"blk.{layer}.ffn_gate_exps.weight", np.ascontiguousarray(gate))
            writer.add_tensor(f"blk.{layer}.ffn_up_exps.weight", np.ascontiguousarray(up))
            continue
        if hf_name.endswith("shared_expert_gate.weight"):
            value = value.reshape(-1)  # llama.cpp's ffn_gate_inp_shexp is a vector
        module, suffix = hf_name, "weight"  # bare parameters (stacked experts) are weights
        if hf_name.endswith((".weight", ".bias")):
            module, _, suffix = hf_name.rpartition(".")
        gguf_name = name_map.get_name(module)
        assert gguf_name is not None, hf_name
        value = np.ascontiguousarray(_llamacpp_layout(arch, hf_name, value))
        if ".ffn_down." in f"{gguf_name}." and suffix == "weight":
            # One quantized tensor checks the dequantize/reshape path on non-F32 data.
            writer.add_tensor(f"{gguf_name}.{suffix}",
                              gguf.quants.quantize(value, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(f"{gguf_name}.{suffix}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


CASES = [("qwen2", True), ("qwen3", False), ("qwen2moe", True), ("qwen3moe", False),
         ("phi3", False), ("gemma2", True), ("gemma3", True), ("gpt2", True)]


@pytest.fixture(scope="module", params=CASES, ids=[a for a, _ in CASES])
def case(request, tmp_path_factory):
    arch, tied = request.param
    root = tmp_path_factory.mktemp(arch)
    model = _hf_model(arch, tied)
    gguf_file = write_gguf(root / f"{arch}.gguf", arch, model)
    out = root / "converted"
    convert_gguf(str(gguf_file), str(out))
    return arch, model, gguf_file, out


def _loaded(directory, **kwargs):
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                             **kwargs)


def test_conversion_equals_transformers_gguf_loading(case):
    arch, original, gguf_file, out = case
    ours, info = _loaded(out, output_loading_info=True)
    ours.eval()
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert type(ours) is type(original)
    for field in ("tie_word_embeddings", "head_dim", "rope_parameters", "sliding_window",
                  "layer_types", "attn_logit_softcapping", "final_logit_softcapping",
                  "n_positions", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "shared_expert_intermediate_size", "norm_topk_prob"):
        assert getattr(ours.config, field, None) == getattr(original.config, field, None), field
    ref = _loaded(gguf_file.parent, gguf_file=gguf_file.name).eval()
    ours_sd, ref_sd, orig_sd = ours.state_dict(), ref.state_dict(), original.state_dict()
    assert ours_sd.keys() == ref_sd.keys() == orig_sd.keys()
    for name, tensor in ref_sd.items():
        assert torch.equal(ours_sd[name], tensor), name
        # And the round trip gives back the original model (Q8_0 up to its rounding).
        # Gemma's norms: (w + 1) - 1 in float32 rounds.
        atol = (0.05 if "down" in name or "mlp.c_proj.weight" in name
                else 1e-6 if "norm" in name else 0.0)
        torch.testing.assert_close(ours_sd[name], orig_sd[name], atol=atol, rtol=0, msg=name)
    ids = torch.tensor([[3, 70, 200, 5, VOCAB - 3]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, ref(ids).logits, atol=1e-5, rtol=1e-5)


def test_pagedlm_greedy_tokens_equal_transformers(case, tmp_path, monkeypatch):
    arch, original, gguf_file, _ = case
    monkeypatch.setenv("PAGEDLM_CACHE_DIR", str(tmp_path / "cache"))
    architecture = type(original).__name__
    if architecture not in supported_architectures():
        # Converted, but the registry has no class for it yet (Qwen3, Gemma on this branch):
        # refused by name, with the list of architectures pagedlm runs.
        with pytest.raises(ValueError, match=rf"{architecture}.*not supported.*LlamaForCausalLM"):
            LLM(str(gguf_file), num_gpu_blocks_override=16)
        return
    llm = LLM(str(gguf_file), num_gpu_blocks_override=32)
    hf = _loaded(float_model_dir(str(gguf_file))).eval()
    # min_tokens masks EOS as min_new_tokens does on the reference side, so both pick the same
    # token where EOS would otherwise win.
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = torch.tensor([out.prompt_token_ids])
        with torch.inference_mode():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NUM_TOKENS,
                              min_new_tokens=NUM_TOKENS, do_sample=False, top_k=None, top_p=None,
                              pad_token_id=VOCAB - 1)
        assert out.outputs[0].token_ids == ref[0, ids.shape[1]:].tolist(), prompt


def test_resolved_config_reads_as_transformers_config(case):
    """The record a metadata directory keeps (resolved_config.py) builds a plain config that
    reads as AutoConfig's class does: every field, defaults and attribute_map aliases."""
    from pagedlm.config import ModelConfig
    from pagedlm.resolved_config import read_resolved_config, record_resolved_config

    _, _, _, out = case
    assert read_resolved_config(out) is None  # convert_gguf alone writes no record
    record_resolved_config(out)
    plain, ref = read_resolved_config(out), transformers.AutoConfig.from_pretrained(out)
    assert type(plain) is transformers.PretrainedConfig
    names = set(ref.to_dict()) | set(type(ref).attribute_map)
    assert {n: getattr(plain, n) for n in names} == {n: getattr(ref, n) for n in names}
    if type(ref).__name__ in ("Gemma3TextConfig", "Qwen3Config", "Qwen3MoeConfig"):
        return  # not in the registry on this branch: ModelConfig refuses them
    ours = ModelConfig.from_dir(None, str(out), "auto", None, 0)
    assert ours.hf_config is not ref and type(ours.hf_config) is transformers.PretrainedConfig
    theirs = dataclasses.replace(ours, hf_config=ref)
    for prop in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "rope_theta",
                 "rope_scaling", "hidden_size", "vocab_size", "max_model_len", "architecture",
                 "derived_max_model_len"):
        assert getattr(ours, prop) == getattr(theirs, prop), prop
    assert ([ours.get_sliding_window(i) for i in range(ours.num_layers)]
            == [theirs.get_sliding_window(i) for i in range(ours.num_layers)])
    # A changed config.json makes the record stale: AutoConfig reads the directory again.
    config_file = Path(out) / "config.json"
    text = config_file.read_text()
    try:
        config_file.write_text(text.replace("{", '{"pagedlm_probe": 1,', 1))
        assert read_resolved_config(out) is None
        assert ModelConfig.from_dir(None, str(out), "auto", None, 0).hf_config.pagedlm_probe == 1
    finally:
        config_file.write_text(text)
    assert read_resolved_config(out) is not None


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3", "gemma2", "gpt2"])
def test_tensor_processors_do_what_transformers_do(arch):
    """gguf_processors' stand-ins give transformers' processors' results, tensor by tensor
    (and the other architectures get transformers' own)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    from pagedlm.model_executor.model_loader.gguf_processors import tensor_processor

    config = {"num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 64}
    ours = tensor_processor(arch, config)
    theirs = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config)
    if arch in ("gemma2", "gpt2"):
        assert type(ours) is type(theirs)
        return
    rng = np.random.default_rng(0)
    for name, rows in (("blk.0.attn_q.weight", 64), ("blk.1.attn_k.weight", 16),
                       ("blk.0.attn_v.weight", 16), ("blk.0.ffn_up.weight", 96),
                       ("output_norm.weight", 64)):
        for weights in (rng.standard_normal((rows, 64)).astype(np.float32),
                        np.arange(rows, dtype=np.float32).reshape(rows, 1)):
            a = ours.process(weights=weights, name=name, tensor_key_mapping={},
                             parsed_parameters={"tensors": {}})
            b = theirs.process(weights=weights, name=name, tensor_key_mapping={},
                               parsed_parameters={"tensors": {}})
            assert a.name == b.name and np.array_equal(a.weights, b.weights), (arch, name)
    assert ours.preprocess_name("model.layers.0.mlp.up_proj.weight") == (
        theirs.preprocess_name("model.layers.0.mlp.up_proj.weight"))


@pytest.mark.parametrize("field, key, axis", [
    ("num_experts", "expert_count", "blk.0.ffn_gate_inp.weight is 4 along its dimension 0"),
    ("moe_intermediate_size", "expert_feed_forward_length", "blk.0.ffn_up_exps.weight is"),
    ("shared_expert_intermediate_size", "expert_shared_feed_forward_length",
     "blk.0.ffn_up_shexp.weight is"),
])
def test_expert_sizes_that_disagree_with_the_tensors_are_refused(tmp_path, field, key, axis):
    """An expert_count of 10**6 over a 4-expert file asked the allocator for 720 GB, its
    error naming no key (found by a fuzz of model files)."""
    model = _hf_model("qwen2moe", False)
    setattr(model.config, field, 10**6)  # the metadata only: the tensors keep their sizes
    gguf_file = write_gguf(tmp_path / "moe.gguf", "qwen2moe", model)
    with pytest.raises(ValueError, match=f"qwen2moe.{key} is 1000000, but {axis}"):
        convert_gguf(str(gguf_file), str(tmp_path / "out"))
