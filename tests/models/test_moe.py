"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) against transformers: greedy
tokens and top-5 logprobs, the experts every token is routed to, both checkpoint layouts of
the experts, errors naming bad weights and fields, and TP=2 against one worker."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedlm import LLM, SamplingParams
from pagedlm.model_executor.layers.fused_moe import FusedMoE, Routing, TopKRouter
from tests.models.test_correctness import PROMPTS, hf_greedy

NUM_TOKENS = 32

# Small enough for a CPU test, with several experts per layer so that routing matters, and
# one dense layer in the Qwen models (mlp_only_layers) to exercise the mixed stacks.
_SHAPE = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.3,
              tie_word_embeddings=False)
_ARCHS = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=96, num_local_experts=6, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(intermediate_size=128, moe_intermediate_size=48, num_experts=6,
                       num_experts_per_tok=2, shared_expert_intermediate_size=80,
                       norm_topk_prob=False, mlp_only_layers=[1])),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(intermediate_size=128, moe_intermediate_size=48, num_experts=6,
                       num_experts_per_tok=2, norm_topk_prob=True, head_dim=32,
                       mlp_only_layers=[1])),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(intermediate_size=128, head_dim=32)),
}
MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")


def make_tiny_moe_model(root, arch: str, default_model_dir: str, **overrides) -> str:
    """A random-weight model of `arch` (a key of _ARCHS) saved with save_pretrained, as
    safetensors, with the SmolLM2 tokenizer."""
    import transformers
    from transformers import AutoTokenizer
    config_name, model_name, extra = _ARCHS[arch]
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    kwargs = dict(_SHAPE, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id, **extra)
    kwargs.update(overrides)
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**kwargs)
    model = getattr(transformers, model_name)(config).eval()
    # transformers initialises norm weights to 1, which would hide a norm loaded into the wrong
    # place (or Qwen3's q_norm / k_norm swapped): make them all distinct.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.3)
    path = os.path.join(str(root), arch)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def hf_model(path: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def assert_matches_transformers(path: str, **llm_kwargs) -> LLM:
    """4 prompts x NUM_TOKENS greedy tokens identical to transformers, every position's top-5
    logprobs within 1e-3 of its, and every KV block back in the pool afterwards."""
    hf = hf_model(path)
    llm = LLM(path, num_gpu_blocks_override=64, **llm_kwargs)
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)
    outs = llm.generate(PROMPTS[:4], params, use_tqdm=False)
    for prompt, out in zip(PROMPTS[:4], outs):
        ids = tok.encode(prompt)
        got = out.outputs[0]
        assert got.token_ids == hf_greedy(hf, tok, ids, NUM_TOKENS, ignore_eos=True), prompt
        with torch.inference_mode():
            ref = torch.log_softmax(hf(torch.tensor([ids + got.token_ids])).logits[0], -1)
        for i, position in enumerate(got.logprobs):
            top = ref[len(ids) - 1 + i].topk(5)
            for tid, val in zip(top.indices.tolist(), top.values.tolist()):
                assert tid in position, (prompt, i)
                assert position[tid].logprob == pytest.approx(val, abs=1e-3), (prompt, i)
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(c == 0 for c in bm.ref_counts)
    return llm


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory, default_model_dir):
    root = tmp_path_factory.mktemp("moe")
    return {arch: make_tiny_moe_model(root, arch, default_model_dir) for arch in MOE_ARCHS}


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_greedy_and_logprobs_match_transformers(moe_models, arch):
    assert_matches_transformers(moe_models[arch])


def _our_model(llm: LLM) -> torch.nn.Module:
    return llm.llm_engine.executor.worker.model


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_routing_matches_transformers_token_for_token(moe_models, arch):
    """Hook both routers over one full prompt: each token's top-k experts, in order, must be
    transformers' in every sparse layer."""
    path = moe_models[arch]
    hf = hf_model(path)
    llm = LLM(path, num_gpu_blocks_override=64)
    prompt = " ".join(PROMPTS)  # ~60 tokens, one prefill step
    ids = llm.get_tokenizer().encode(prompt)

    ours: dict[str, list[torch.Tensor]] = {}
    hooks = []
    for name, module in _our_model(llm).named_modules():
        if isinstance(module, TopKRouter):
            def keep(mod, args, out: Routing, name=name):
                ours.setdefault(name, []).append(out.topk_ids.clone())
            hooks.append(module.register_forward_hook(keep))
    theirs: dict[str, torch.Tensor] = {}
    for name, module in hf.named_modules():
        if name.endswith((".mlp.gate", ".block_sparse_moe.gate")):
            # transformers' routers return (logits, top-k weights, top-k indices).
            module.register_forward_hook(
                lambda mod, args, out, name=name: theirs.__setitem__(name, out[2].clone()))
    llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1),
                 use_tqdm=False)
    for h in hooks:
        h.remove()
    with torch.inference_mode():
        hf(torch.tensor([ids]))

    # The Qwen models' layer 1 is dense (mlp_only_layers): neither side routes there.
    sparse = [0, 2] if arch != "mixtral" else [0, 1, 2]
    assert sorted(ours) == [f"layers.{i}.mlp.gate" for i in sparse]
    assert len(theirs) == len(sparse)
    for i in sparse:
        got = torch.cat(ours[f"layers.{i}.mlp.gate"])
        want = next(v for k, v in theirs.items() if f"layers.{i}." in k)
        assert got.shape == want.shape == (len(ids), 2)
        assert torch.equal(got, want), f"layer {i}"
        # Not a degenerate router: the prompt spreads over most of the experts.
        assert got.unique().numel() >= 4


def test_qwen2_moe_decoder_sparse_step_and_default_qkv_bias(tmp_path, default_model_dir):
    """Every second layer sparse (decoder_sparse_step=2), no mlp_only_layers, a config
    without qkv_bias (as written before transformers 5: Qwen2-MoE always has the bias)."""
    path = make_tiny_moe_model(tmp_path, "qwen2_moe", default_model_dir, decoder_sparse_step=2,
                               mlp_only_layers=[], norm_topk_prob=True)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    assert cfg.pop("qkv_bias") is True
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    llm = assert_matches_transformers(path)
    layers = _our_model(llm).layers
    assert [isinstance(getattr(layers[str(i)].mlp, "experts", None), FusedMoE)
            for i in range(3)] == [False, True, False]


def test_experts_stored_stacked_load_the_same(moe_models, tmp_path):
    """transformers 5 holds experts as 3-D gate_up_proj / down_proj tensors; a checkpoint
    written from its state_dict in that layout gives the same outputs."""
    src = moe_models["qwen2_moe"]
    dst = str(tmp_path / "stacked")
    shutil.copytree(src, dst)
    state = {k: v.contiguous() for k, v in hf_model(src).state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    os.remove(os.path.join(dst, "model.safetensors"))
    save_file(state, os.path.join(dst, "model.safetensors"))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    a, b = (LLM(p, num_gpu_blocks_override=16).generate(PROMPTS[:2], params, use_tqdm=False)
            for p in (src, dst))
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert x.outputs[0].cumulative_logprob == pytest.approx(y.outputs[0].cumulative_logprob,
                                                                abs=1e-5)


def test_a_missing_expert_weight_is_named(moe_models, tmp_path):
    dst = str(tmp_path / "missing")
    shutil.copytree(moe_models["mixtral"], dst)
    f = os.path.join(dst, "model.safetensors")
    state = load_file(f)
    del state["model.layers.2.block_sparse_moe.experts.5.w2.weight"]
    save_file(state, f)
    with pytest.raises(ValueError, match=r"layers\.2\.mlp\.experts\.w2_weight"):
        LLM(dst, num_gpu_blocks_override=16)


def test_too_many_experts_per_token_is_a_value_error(moe_models, tmp_path):
    dst = str(tmp_path / "topk")
    shutil.copytree(moe_models["qwen3_moe"], dst)
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg["num_experts_per_tok"] = 7
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        LLM(dst, num_gpu_blocks_override=16)


@pytest.mark.slow
@pytest.mark.parametrize("arch,layout", [("qwen2_moe", dict(tensor_parallel_size=2)),
                                         ("qwen2_moe", dict(pipeline_parallel_size=2)),
                                         ("mixtral", dict(tensor_parallel_size=2)),
                                         ("qwen3_moe", dict(tensor_parallel_size=2))],
                         ids=["qwen2_moe-tp2", "qwen2_moe-pp2", "mixtral-tp2", "qwen3_moe-tp2"])
def test_moe_over_mp_matches_one_worker(moe_models, arch, layout):
    """Experts split over their intermediate dim (plus Qwen2-MoE's shared expert), one
    all-reduce per block (TP); sparse and dense layers on different stages (PP)."""
    from tests.distributed.test_distributed_executor import assert_no_workers_left, assert_same, run
    path = moe_models[arch]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    ref = run(path, params)
    assert_same(ref, run(path, params, distributed_executor_backend="mp", **layout))
    assert_no_workers_left()
