"""Sliding-window attention and logit soft-capping: the paged-attention backends against a dense
reference, and Mistral end to end against transformers' own sliding-window attention.

Unit tests reuse test_paged_attention's random paged-cache scenarios (decodes, fresh prompts,
chunks with earlier context) and add a window and a soft cap to the dense float64 reference.
"""
from __future__ import annotations

import math
import shutil

import pytest
import torch

from pagedlm import LLM, SamplingParams
from pagedlm.attention.backends import paged_attention
from pagedlm.kernels import attention as attn
from tests.kernels.test_paged_attention import _scenario
from tests.conftest import needs_kernels

TOL = 2e-5


def _dense(query, dense, scale, window=None, cap=None):
    """Per-row softmax attention in float64 over the row's last `window` keys, scores capped."""
    out = torch.empty_like(query)
    for i, (k, v) in enumerate(dense):  # k/v: the row's keys at positions 0 .. its own
        if window is not None:
            k, v = k[-window:], v[-window:]
        group = query.shape[1] // k.shape[1]
        k = k.double().repeat_interleave(group, dim=1)
        v = v.double().repeat_interleave(group, dim=1)
        s = torch.einsum("hd,lhd->hl", query[i].double(), k) * scale
        if cap is not None:
            s = cap * torch.tanh(s / cap)
        out[i] = torch.einsum("hl,lhd->hd", s.softmax(-1), v).float()
    return out


def _run(sc, disable, monkeypatch, window=None, cap=None):
    query, key, value, k_cache, v_cache, meta, _ = sc
    if disable:
        monkeypatch.setenv("PAGEDLM_DISABLE_KERNELS", "1")
    else:
        monkeypatch.delenv("PAGEDLM_DISABLE_KERNELS", raising=False)
    try:
        return paged_attention(query, key, value, k_cache.clone(), v_cache.clone(), meta,
                               1 / math.sqrt(query.shape[-1]), sliding_window=window,
                               logits_soft_cap=cap)
    finally:
        monkeypatch.delenv("PAGEDLM_DISABLE_KERNELS", raising=False)


CASES = [
    # (decode context lengths, prefill chunks (context_len, chunk_len)); windows below are
    # shorter than most contexts, equal to some, longer than others.
    ([1, 5, 32, 33, 100, 257], []),
    ([3, 200, 77], [(45, 7)]),          # decodes + a short chunk with context (kernel)
    ([9], [(0, 50), (130, 5), (0, 3)]),  # fresh prompts longer and shorter than the window
    ([4, 50], [(30, 40), (17, 16)]),   # a long chunk with context (SDPA in both backends)
    ([], [(1, 1), (63, 20), (0, 33)]),
]
SETTINGS = [(32, None), (1, None), (17, None), (None, 5.0), (32, 2.0), (300, 50.0)]


@pytest.mark.parametrize("disable", [pytest.param(False, marks=needs_kernels), True],
                         ids=["kernel", "torch"])
@pytest.mark.parametrize("window,cap", SETTINGS)
@pytest.mark.parametrize("decode_lens,chunks", CASES)
def test_window_and_soft_cap_match_dense(decode_lens, chunks, window, cap, disable, monkeypatch):
    sc = _scenario(hash((tuple(decode_lens), tuple(chunks))) % 2**31, decode_lens, chunks,
                   2, 3, 64)
    # Sharper scores, so the soft cap actually bends them.
    sc = (sc[0] * 4, *sc[1:])
    got = _run(sc, disable, monkeypatch, window, cap)
    ref = _dense(sc[0], sc[6], 1 / 8, window, cap)
    assert torch.isfinite(got).all()
    assert (got - ref).abs().max().item() < TOL
    # The window and cap change the result (the test would notice if they were ignored).
    plain = _dense(sc[0], sc[6], 1 / 8)
    if (window is not None and window < max(decode_lens + [c + n for c, n in chunks])) or cap:
        assert (got - plain).abs().max().item() > 1e-3


@needs_kernels
@pytest.mark.parametrize("decode_lens,chunks", CASES)
def test_kernel_matches_torch_path_with_window_and_cap(decode_lens, chunks, monkeypatch):
    sc = _scenario(5, decode_lens, chunks, 4, 2, 128, block_size=8)
    got = _run(sc, False, monkeypatch, 24, 30.0)
    ref = _run(sc, True, monkeypatch, 24, 30.0)
    assert (got - ref).abs().max().item() < TOL


@needs_kernels
def test_kernel_skips_keys_outside_the_window():
    """Blocks wholly before every window are never read: poisoning them (and their block-table
    entries) changes nothing."""
    g = torch.Generator().manual_seed(0)
    bs, window = 16, 20
    k_cache = torch.randn(12, bs, 2, 64, generator=g)
    v_cache = torch.randn(12, bs, 2, 64, generator=g)
    tables = torch.arange(12, dtype=torch.int32).view(2, 6).contiguous()
    query = torch.randn(3, 4, 64, generator=g)
    token_seq = torch.tensor([0, 1, 1], dtype=torch.int32)
    ctx = torch.tensor([96, 70, 71], dtype=torch.int32)  # windows start at 76, 50, 51
    ref = attn.paged_attention(query, k_cache, v_cache, tables, token_seq, ctx, 0.125,
                               sliding_window=window)
    poisoned_k, poisoned_v, bad_tables = k_cache.clone(), v_cache.clone(), tables.clone()
    for row, first_needed in ((0, 76 // bs), (1, 50 // bs)):
        for b in range(first_needed):
            poisoned_k[tables[row, b]] = float("nan")
            poisoned_v[tables[row, b]] = float("nan")
            bad_tables[row, b] = 10**6  # out of range: reading it would crash or be garbage
    got = attn.paged_attention(query, poisoned_k, poisoned_v, bad_tables, token_seq, ctx,
                               0.125, sliding_window=window)
    assert torch.equal(got, ref)


def test_bad_window_or_cap_is_a_value_error():
    from pagedlm.attention.layer import Attention
    with pytest.raises(ValueError, match="sliding_window"):
        Attention(4, 16, 0.25, 2, sliding_window=0)
    with pytest.raises(ValueError, match="logits_soft_cap"):
        Attention(4, 16, 0.25, 2, logits_soft_cap=-1.0)


# -- end to end against transformers ---------------------------------------------------------

LONG_PROMPTS = [
    "The capital of France is a city that has seen kings, revolutions, and empires rise and "
    "fall. Its streets are lined with cafes, its river is crossed by dozens of bridges, and",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "
    "fibonacci(n - 2)\n\n\ndef factorial(n):\n    result = 1\n    for i in range(2, n + 1):",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "woman who kept bees, a goat, and a secret that nobody in the village",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22,",
]


def make_hf_model(root, name: str, config_cls, model_cls, tokenizer_dir: str,
                  embed_std: float | None = None, **overrides):
    """A random-weight transformers model saved as safetensors with the SmolLM2 tokenizer;
    returns (path, the model in float32 eval mode). embed_std re-draws the embedding (a tied
    head over a large embedding keeps predicting the input token)."""
    import os
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    kwargs = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, rms_norm_eps=1e-6,
                  # Larger weights give peaked logits, so greedy choices are not near-ties.
                  initializer_range=0.3, tie_word_embeddings=False,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.eos_token_id)
    kwargs.update(overrides)
    torch.manual_seed(0)
    # Eager attention: transformers' reference implementation, which applies the window
    # (and Gemma 2's soft cap) itself.
    config = config_cls(**kwargs)
    config._attn_implementation = "eager"
    model = model_cls(config).eval()
    with torch.no_grad():  # norms start at 1 (or Gemma's 0 offset): make their weights matter
        for pname, param in model.named_parameters():
            if "norm" in pname:
                param.add_(0.3 * torch.randn_like(param))
        if embed_std is not None:
            model.get_input_embeddings().weight.normal_(0.0, embed_std)
    path = os.path.join(str(root), name)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, model


_HF_GREEDY: dict = {}  # (model id, prompt, length) -> tokens: backends share one reference


def hf_greedy(model, prompt_ids: list[int], max_new: int) -> list[int]:
    """transformers' greedy tokens, EOS ignored."""
    key = (id(model), tuple(prompt_ids), max_new)
    if key not in _HF_GREEDY:
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new,
                                 min_new_tokens=max_new, do_sample=False, top_k=None,
                                 top_p=None, attention_mask=torch.ones(1, len(prompt_ids)))
        _HF_GREEDY[key] = out[0, len(prompt_ids):].tolist()
    return _HF_GREEDY[key]


def assert_matches_hf(llm: LLM, hf_model, prompts: list[str], max_tokens: int,
                      top: int = 5, tol: float = 1e-3) -> list[list[int]]:
    """Greedy tokens identical to transformers', top-`top` logprobs within `tol` at every
    position, and every KV block back in the pool afterwards. Returns the token ids."""
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            logprobs=top)
    outs = llm.generate(prompts, params, use_tqdm=False)
    results = []
    for prompt, out in zip(prompts, outs):
        ids = tok.encode(prompt)
        got = out.outputs[0].token_ids
        assert got == hf_greedy(hf_model, ids, max_tokens), prompt
        with torch.inference_mode():
            ref = torch.log_softmax(hf_model(torch.tensor([ids + got])).logits[0].float(), -1)
        for i, position in enumerate(out.outputs[0].logprobs):
            best = ref[len(ids) - 1 + i].topk(top)
            for tid, val in zip(best.indices.tolist(), best.values.tolist()):
                assert tid in position, (prompt, i)
                assert position[tid].logprob == pytest.approx(val, abs=tol), (prompt, i)
        results.append(got)
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(c == 0 for c in bm.ref_counts)
    return results


@pytest.fixture(params=["kernel", "torch"])
def backend(request, monkeypatch):
    """Runs the test once with the native kernel and once with the PyTorch path (the backend
    is chosen when the model is built, reading PAGEDLM_DISABLE_KERNELS)."""
    if request.param == "kernel":
        if shutil.which("gcc") is None:
            pytest.skip("no C compiler")
        monkeypatch.delenv("PAGEDLM_DISABLE_KERNELS", raising=False)
    else:
        monkeypatch.setenv("PAGEDLM_DISABLE_KERNELS", "1")
    return request.param


def _check_backend(llm: LLM, backend: str) -> None:
    from pagedlm.attention.layer import Attention
    model = llm.llm_engine.executor.worker.model
    names = {m.backend.name for m in model.modules() if isinstance(m, Attention)}
    assert names == {"native_kernel" if backend == "kernel" else "torch_sdpa"}


WINDOW = 32
LONG_TOKENS = 90  # prompts of 37-52 tokens + 90 outputs: > 120 tokens, several windows


@pytest.fixture(scope="module")
def mistral(tmp_path_factory, default_model_dir):
    from transformers import MistralConfig, MistralForCausalLM
    path, model = make_hf_model(tmp_path_factory.mktemp("mistral"), "mistral", MistralConfig,
                                MistralForCausalLM, default_model_dir, sliding_window=WINDOW)
    return path, model


def test_mistral_window_matches_transformers(mistral, backend):
    path, hf_model = mistral
    # Small chunks: each prompt is prefilled in pieces that read earlier context (short ones
    # through the kernel, the rest through SDPA), and decodes run next to prefills.
    llm = LLM(path, max_num_batched_tokens=24, max_num_seqs=4, enable_chunked_prefill=True,
              num_gpu_blocks_override=64)
    assert llm.llm_engine.config.model_config.max_model_len == 512  # not cut to the window
    first = assert_matches_hf(llm, hf_model, LONG_PROMPTS, LONG_TOKENS)
    assert min(len(llm.get_tokenizer().encode(p)) for p in LONG_PROMPTS) + LONG_TOKENS > 120
    # Again: the prompts' blocks now come from the prefix cache (chunks with cached context).
    again = llm.generate(LONG_PROMPTS, SamplingParams(temperature=0, max_tokens=LONG_TOKENS,
                                                      ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == first
    assert llm.llm_engine.block_manager.num_free_blocks == llm.llm_engine.block_manager.num_blocks
    _check_backend(llm, backend)


def test_mistral_window_is_applied_by_the_reference(mistral):
    """The reference really uses a window: without it, transformers' logits differ."""
    path, hf_model = mistral
    from transformers import MistralForCausalLM
    full = MistralForCausalLM.from_pretrained(path, dtype=torch.float32, sliding_window=None,
                                              attn_implementation="eager").eval()
    ids = torch.tensor([list(range(100, 100 + 3 * WINDOW))])
    with torch.inference_mode():
        a, b = hf_model(ids).logits[0], full(ids).logits[0]
    assert torch.allclose(a[:WINDOW], b[:WINDOW], atol=1e-5)  # inside the window: the same
    assert (a[WINDOW:] - b[WINDOW:]).abs().max() > 1e-2


def test_mistral_window_under_preemption(mistral):
    """Recompute after preemption rebuilds windowed context exactly: a cache too small for all
    four sequences at once gives the same tokens as transformers."""
    path, hf_model = mistral
    llm = LLM(path, max_num_batched_tokens=32, max_num_seqs=4, num_gpu_blocks_override=20)
    assert_matches_hf(llm, hf_model, LONG_PROMPTS, LONG_TOKENS)
    assert llm.llm_engine.stats.num_preemptions > 0


@pytest.mark.parametrize("overrides", [
    dict(use_sliding_window=True, sliding_window=16, max_window_layers=1),
    dict(use_sliding_window=True, sliding_window=16, max_window_layers=0),
    dict(use_sliding_window=False, sliding_window=16, max_window_layers=1),
])
def test_qwen2_windowed_layers_follow_transformers(tmp_path, default_model_dir, overrides):
    """Which layers are windowed (use_sliding_window, max_window_layers) is read as
    transformers reads it: the per-layer windows equal its attention modules'."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from pagedlm.config import ModelConfig
    path, hf_model = make_hf_model(tmp_path, "qwen2", Qwen2Config, Qwen2ForCausalLM,
                                   default_model_dir, **overrides)
    cfg = ModelConfig.from_dir(path, path, "auto", None, 0)
    expected = [layer.self_attn.sliding_window for layer in hf_model.model.layers]
    assert [cfg.get_sliding_window(i) for i in range(cfg.num_layers)] == expected
    assert cfg.max_model_len == 512


def test_qwen2_partly_windowed_matches_transformers(tmp_path, default_model_dir):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    path, hf_model = make_hf_model(tmp_path, "qwen2", Qwen2Config, Qwen2ForCausalLM,
                                   default_model_dir, use_sliding_window=True,
                                   sliding_window=16, max_window_layers=1)
    llm = LLM(path, max_num_batched_tokens=16, max_num_seqs=4, num_gpu_blocks_override=64)
    assert_matches_hf(llm, hf_model, LONG_PROMPTS[:2], 24)
