"""quantization="gguf" loads a GGUF file as it is: weights from the memory-mapped file, kept in
their blocks, no float copy written (the cache directory holds metadata only) or held (no float
weight for a quantized layer or a quantized embedding), fused layers whose shards are of
different block types kept quantized, the token embedding looked up in its blocks, and the
result against the float32 path on the same file. Tiny Llama files, a file alone in its folder.
"""
from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from pagedlm import LLM, SamplingParams
from pagedlm.model_executor.layers.linear import RowParallelLinear
from pagedlm.model_executor.layers.quantization import gguf as gguf_method
from pagedlm.model_executor.layers.quantization import kernels, resolve_quantization
from pagedlm.model_executor.model_loader.gguf_weights import GGUFBlocks, GGUFWeights
from pagedlm.model_executor.model_loader.model_path import FLOAT_WEIGHTS_FILE, resolve_model
from tests.conftest import needs_kernels
from tests.models.test_model_loading import TINY, _tiny_hf_state, write_tiny_gguf

PROMPTS = ["the cat sat on", "Hello, world", "1, 2, 3, 4,", "def f(x):"]
NUM_TOKENS = 8


def _types() -> dict[str, T]:
    """Layer 0: q/k Q4_1 with v Q8_0 (one fused q/k/v of two formats), gate Q8_0 with up Q4_1;
    layer 1 all Q4_0 (converted to q4_1) but down Q8_0; the tied embedding Q8_0."""
    types = {"model.embed_tokens.weight": T.Q8_0}
    layer0 = {"q_proj": T.Q4_1, "k_proj": T.Q4_1, "v_proj": T.Q8_0, "o_proj": T.Q4_1,
              "gate_proj": T.Q8_0, "up_proj": T.Q4_1, "down_proj": T.Q4_1}
    for name, qtype in layer0.items():
        kind = "self_attn" if name[0] in "qkvo" else "mlp"
        types[f"model.layers.0.{kind}.{name}.weight"] = qtype
        types[f"model.layers.1.{kind}.{name}.weight"] = T.Q8_0 if name == "down_proj" else T.Q4_0
    return types


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    # Alone in its folder: no config, tokenizer or weights beside it.
    folder = tmp_path_factory.mktemp("standalone")
    return write_tiny_gguf(folder / "tiny.gguf", _tiny_hf_state(False, False), types=_types())


def _run_both(gguf_file: Path, cache: Path) -> dict:
    """The file on its blocks, then on the float32 path: greedy tokens and their logprobs,
    each model, and the cache directory's files after each."""
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLM_CACHE_DIR", str(cache))
        model_dir = resolve_model(str(gguf_file))
        for q in ("gguf", None):
            llm = LLM(str(gguf_file), quantization=q, num_gpu_blocks_override=32)
            params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True,
                                    logprobs=0)
            outs = llm.generate(PROMPTS, params, use_tqdm=False)
            out[q] = {"tokens": [list(o.outputs[0].token_ids) for o in outs],
                      "logprobs": [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids,
                                                                    o.outputs[0].logprobs)]
                                   for o in outs],
                      "files": sorted(p.name for p in Path(model_dir).iterdir()),
                      "model": llm.llm_engine.executor.worker.model}
            del llm
            gc.collect()
    out["model"] = out["gguf"]["model"]
    return out


@pytest.fixture(scope="module")
def runs(gguf_file, tmp_path_factory):
    return _run_both(gguf_file, tmp_path_factory.mktemp("cache"))


def test_standalone_file_loads_without_a_float_copy(runs):
    assert FLOAT_WEIGHTS_FILE not in runs["gguf"]["files"], runs["gguf"]["files"]
    assert "tokenizer.json" in runs["gguf"]["files"] and "config.json" in runs["gguf"]["files"]
    # The float path, asked for afterwards, writes its copy then.
    assert FLOAT_WEIGHTS_FILE in runs[None]["files"]


def test_no_float_weight_is_held_for_quantized_layers(runs):
    model = runs["model"]
    h, vocab = TINY["hidden"], TINY["vocab"]
    # Parameters left: the norms (2 per layer and the final one), nothing else.
    params = dict(model.named_parameters())
    assert all("norm" in name for name in params), sorted(params)
    assert sum(p.numel() for p in params.values()) == (2 * TINY["layers"] + 1) * h
    assert not any(p.is_meta for p in model.parameters())
    embed = model.embed_tokens
    assert embed.weight is None and embed.row_lookup.blocks.shape == (vocab, h // 32, 34)
    formats = {name: m.quant_format for name, m in model.named_modules()
               if hasattr(m, "quant_format")}
    assert formats["layers.0.self_attn.qkv_proj"] == "q4_1+q8_0"
    assert formats["layers.0.mlp.gate_up_proj"] == "q4_1+q8_0"
    assert formats["layers.1.self_attn.qkv_proj"] == "q4_1"  # Q4_0, converted
    assert formats["layers.1.mlp.down_proj"] == "q8_0"
    assert formats["lm_head"] == "q8_0"


def test_blocks_come_from_the_file_as_stored(gguf_file, runs):
    """An unpermuted tensor's blocks are the mapped file's bytes as they are (no copy), the tied
    head multiplies by the embedding's own blocks, and embedding lookups dequantize their rows
    bit for bit as gguf-py does."""
    model = runs["model"]
    weights = dict(GGUFWeights(str(gguf_file)).weights({"Q4_0", "Q4_1", "Q8_0"}))
    embed = model.embed_tokens
    assert model.lm_head.qweight_data.data_ptr() == embed.row_lookup.blocks.data_ptr()
    file_rows = weights["model.embed_tokens.weight"]
    assert torch.equal(embed.row_lookup.blocks, file_rows.blocks)
    ids = torch.tensor([0, 5, TINY["vocab"] - 1, 5])
    assert torch.equal(embed(ids), file_rows.dequantized()[ids])
    down = model.layers["1"].mlp.down_proj
    assert torch.equal(down.qweight_data, weights["model.layers.1.mlp.down_proj.weight"].blocks)


def test_mixed_fused_layer_runs_each_shard_in_its_format(runs):
    """The q/k/v layer of two formats computes, slice by slice, what each shard's kernel does."""
    layer = runs["model"].layers["0"].self_attn.qkv_proj
    x = torch.randn(3, TINY["hidden"])
    y = layer(x)
    row = 0
    for fmt, offset, blocks in layer.quant_shards:
        assert offset == row
        rows = blocks.shape[0]
        assert torch.equal(y[:, row:row + rows], kernels.quantized_matmul(fmt, x, blocks))
        ref = x.double() @ kernels.dequantize(fmt, blocks).double().T
        # 8-bit activations, as llama.cpp's kernels take them.
        assert (y[:, row:row + rows] - ref).abs().max() < 0.02 * ref.abs().max()
        row += rows
    assert row == y.shape[1]


def _dequantized(layer) -> torch.Tensor:
    shards = getattr(layer, "quant_shards", None)
    if shards is None:
        return kernels.dequantize(layer.quant_format, layer.qweight_data)
    return torch.cat([kernels.dequantize(fmt, blocks) for fmt, _, blocks in shards])


def test_quantized_path_against_the_float_path(runs):
    """The float32 path on the same file runs the blocks dequantized: every layer's blocks
    (q/k rows unpermuted, shards in place) dequantize bit for bit to its float weight. The
    kernels take their input at 8 bits per 32-block, as llama.cpp's do, so logprobs differ a
    little and this flat random model's near-ties flip tokens (measured: first tokens 3/4
    identical, logprobs where the tokens agree 0.21 apart at most, 0.08 on average)."""
    quantized, floats = runs["gguf"]["model"], runs[None]["model"]
    float_layers = dict(floats.named_modules())
    checked = 0
    for name, layer in quantized.named_modules():
        if hasattr(layer, "quant_format"):
            weight = _dequantized(layer)
            # The float LM head has the vocabulary's zero padding rows beyond the file's.
            assert torch.equal(weight, float_layers[name].weight[:len(weight)]), name
            checked += 1
    assert checked == 4 * TINY["layers"] + 1
    ids = torch.arange(TINY["vocab"])
    assert torch.equal(quantized.embed_tokens(ids), floats.embed_tokens.weight[ids])

    firsts = sum(a[0] == b[0] for a, b in zip(runs["gguf"]["tokens"], runs[None]["tokens"]))
    diffs = []
    for qa, fa, qt, ft in zip(runs["gguf"]["logprobs"], runs[None]["logprobs"],
                              runs["gguf"]["tokens"], runs[None]["tokens"]):
        n = next((i for i, (a, b) in enumerate(zip(qt, ft)) if a != b), len(qt))
        diffs += np.abs(np.array(qa[:n]) - np.array(fa[:n])).tolist()
    print(f"first tokens identical {firsts}/{len(PROMPTS)}; logprob differences max "
          f"{max(diffs):.4f}, mean {np.mean(diffs):.4f}")
    assert firsts >= len(PROMPTS) - 1
    assert max(diffs) < 0.3 and np.mean(diffs) < 0.1


def test_default_keeps_a_large_file_quantized(gguf_file, monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDLM_CACHE_DIR", str(tmp_path))
    model_dir = resolve_model(str(gguf_file))
    assert resolve_quantization(None, model_dir) is None  # small: float32
    assert resolve_quantization("int8", model_dir) == "int8"
    monkeypatch.setattr(gguf_method, "GGUF_FLOAT_COPY_LIMIT_BYTES", 1000)
    assert resolve_quantization(None, model_dir) == "gguf"


def test_tensor_parallel_split_that_cuts_a_block_is_refused():
    layer = RowParallelLinear(64, 8)
    # As rank 1 of 2 would be built with 64 features: 32 a rank is whole blocks, 16 is not.
    layer.tp_size, layer.tp_rank, layer.quant_prefix = 2, 1, "model.layers.0.mlp.down_proj"
    blocks = GGUFBlocks("Q8_0", torch.zeros(8, 2, 34, dtype=torch.uint8), 64)
    method = gguf_method.GGUFLinearMethod()
    method.attach(layer)
    layer.input_size_per_partition = 32
    layer.weight.weight_loader(layer.weight, blocks)
    assert layer.weight.gguf_parts[-1].blocks.shape == (8, 1, 34)
    layer.input_size_per_partition = 16
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 splits the 64 input features "
                                         r"of model.layers.0.mlp.down_proj into 16 per rank"):
        layer.weight.weight_loader(layer.weight, blocks)


# ---------------------------------------------------------------- K-quants, as Q4_K_M mixes them

K_HIDDEN, K_FFN, K_HEADS, K_KV_HEADS = 256, 512, 4, 2


def _write_kquant_gguf(path: Path) -> Path:
    """A one-layer Llama 256 wide of random valid K-quant blocks (gguf-py cannot quantize
    K-quants): q/k/gate/up Q4_K with v and down Q6_K (Q4_K_M's mix), a tied Q6_K embedding,
    F32 norms."""
    import gguf

    from tests.kernels.test_kquant_kernels import random_blocks
    from tests.models.test_model_loading import _byte_level_tokens
    vocab = TINY["vocab"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(4096)
    writer.add_embedding_length(K_HIDDEN)
    writer.add_feed_forward_length(K_FFN)
    writer.add_head_count(K_HEADS)
    writer.add_head_count_kv(K_KV_HEADS)
    writer.add_rope_dimension_count(K_HIDDEN // K_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(_byte_level_tokens())
    writer.add_token_merges(["Ġ t", "h e"])
    writer.add_bos_token_id(vocab - 2)
    writer.add_eos_token_id(vocab - 1)
    kv = K_KV_HEADS * K_HIDDEN // K_HEADS
    tensors = {"token_embd.weight": ("q6_k", vocab, K_HIDDEN),
               "blk.0.attn_q.weight": ("q4_k", K_HIDDEN, K_HIDDEN),
               "blk.0.attn_k.weight": ("q4_k", kv, K_HIDDEN),
               "blk.0.attn_v.weight": ("q6_k", kv, K_HIDDEN),
               "blk.0.attn_output.weight": ("q4_k", K_HIDDEN, K_HIDDEN),
               "blk.0.ffn_gate.weight": ("q4_k", K_FFN, K_HIDDEN),
               "blk.0.ffn_up.weight": ("q4_k", K_FFN, K_HIDDEN),
               "blk.0.ffn_down.weight": ("q6_k", K_HIDDEN, K_FFN)}
    for seed, (name, (fmt, n, k)) in enumerate(tensors.items()):
        blocks = random_blocks(fmt, n, k, seed).numpy()
        writer.add_tensor(name, blocks.reshape(n, -1),
                          raw_dtype=gguf.GGMLQuantizationType[fmt.upper()])
    rng = np.random.default_rng(0)
    for name in ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight"):
        writer.add_tensor(name, (1 + 0.1 * rng.standard_normal(K_HIDDEN)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def kquant_runs(tmp_path_factory):
    path = _write_kquant_gguf(tmp_path_factory.mktemp("kquant") / "tiny-q4_k_m.gguf")
    return _run_both(path, tmp_path_factory.mktemp("kcache"))


def test_kquant_mix_stays_quantized_and_matches_the_float_path(kquant_runs):
    """Q4_K_M's mix: the q/k/v layer runs Q4_K and Q6_K shards side by side, gate/up two Q4_K
    shards, the embedding and tied head stay Q6_K; every layer's blocks dequantize bit
    for bit to the float path's weights (measured: greedy tokens of the 4 prompts identical
    on the first token)."""
    model, floats = kquant_runs["gguf"]["model"], kquant_runs[None]["model"]
    formats = {name: m.quant_format for name, m in model.named_modules()
               if hasattr(m, "quant_format")}
    assert formats == {"layers.0.self_attn.qkv_proj": "q4_k+q6_k",
                       "layers.0.self_attn.o_proj": "q4_k",
                       "layers.0.mlp.gate_up_proj": "q4_k", "layers.0.mlp.down_proj": "q6_k",
                       "lm_head": "q6_k"}, formats
    assert all("norm" in name for name, _ in model.named_parameters())
    # gate/up of one block type: two shards, each still the mapped file's pages (memory torch
    # did not allocate, as a joined copy would be).
    gate_up = model.layers["0"].mlp.gate_up_proj
    assert [(fmt, row) for fmt, row, _ in gate_up.quant_shards] == [("q4_k", 0), ("q4_k", K_FFN)]
    assert not any(blocks.untyped_storage().resizable() for _, _, blocks in gate_up.quant_shards)
    float_layers = dict(floats.named_modules())
    for name in formats:
        weight = _dequantized(dict(model.named_modules())[name])
        assert torch.equal(weight, float_layers[name].weight[:len(weight)]), name
    ids = torch.arange(TINY["vocab"])
    assert torch.equal(model.embed_tokens(ids), floats.embed_tokens.weight[ids])
    firsts = sum(a[0] == b[0] for a, b in zip(kquant_runs["gguf"]["tokens"],
                                             kquant_runs[None]["tokens"]))
    print(f"K-quant mix: first tokens identical {firsts}/{len(PROMPTS)}")
    assert firsts >= len(PROMPTS) - 1


@needs_kernels
@pytest.mark.parametrize("kquants,deterministic", [(False, False), (True, True)])
def test_fused_decode_runs_mixed_fused_layers(gguf_file, tmp_path_factory, monkeypatch,
                                              kquants, deterministic):
    """A fused layer of shards in different formats (the Q4_1/Q8_0 file: q/k|v and gate|up;
    Q4_K_M's mix: q/k Q4_K with v Q6_K) runs in the fused decode stack, each shard's rows in
    its own format (llama_decode.c's row segments), and gives the layer-by-layer tokens and
    logprobs bit for bit, at one and several sequences (deterministic=True: every decode
    step fused, the 10-sequence ones too)."""
    from tests.kernels.test_fused_decode import _run
    if kquants:
        path = _write_kquant_gguf(tmp_path_factory.mktemp("kq") / "tiny-q4_k_m.gguf")
        segments = {"qkv": [3], "gate_up": [2]}  # q|k|v; gate|up, both Q4_K
    else:  # fused layers keep their shards even in one format (layer 1's are all Q4_1)
        path, segments = gguf_file, {"qkv": [3, 3], "gate_up": [2, 2]}
    monkeypatch.setenv("PAGEDLM_CACHE_DIR", str(tmp_path_factory.mktemp("fcache")))
    args = {"quantization": "gguf", "deterministic": deterministic}
    ref, off = _run(str(path), False, monkeypatch, **args)
    got, on = _run(str(path), True, monkeypatch, **args)
    assert on.off_reason is None and on.stack.steps > 20
    assert off.stack is None
    got_segments = {name: sorted(getattr(layer, name).nseg for layer in on.stack.layers)
                    for name in segments}
    assert got_segments == segments
    assert got == ref  # tokens and every logprob, bit for bit
