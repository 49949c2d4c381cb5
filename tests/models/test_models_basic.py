"""OPT, GPT-2 and Phi-3 against transformers: tiny random models built with transformers' own
config and model classes, saved as safetensors with the SmolLM2 tokenizer, run through pagedlm
(paged KV cache, chunked prefill) and through transformers' generate().

Greedy tokens must be identical over 32 tokens for 4 prompts and the top-5 logprobs of every
step within 1e-3 of transformers' logits at that step; every KV block must be back in the pool
afterwards. The slow tests check TP=2 (and PP=2 for GPT-2 and OPT) over the mp executor against
one worker.
"""
from __future__ import annotations

import json
import os
import time

import psutil
import pytest
import torch

from pagedlm import LLM, SamplingParams
from tests.compare_utils import assert_greedy_logprobs_match

PROMPTS = [
    "The capital of France is a city that",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "1, 2, 3, 4,",
]
NUM_TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)

# Phi-3 longrope: a small original context, so short prompts cross it within 32 tokens.
PHI3_ORIGINAL = 48
PHI3_ROPE = {"rope_type": "longrope", "rope_theta": 10000.0,
             # head_dim 16 -> 8 frequency pairs. The sets differ a lot, so using the wrong one
             # changes the tokens.
             "short_factor": [1.0, 1.1, 1.2, 1.3, 1.5, 1.8, 2.0, 2.5],
             "long_factor": [1.0, 2.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0]}


# -- builders ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(default_model_dir)


def save_tiny(root, name: str, config_cls, model_cls, tokenizer, **kwargs) -> str:
    """A random model of transformers' `model_cls` saved as safetensors with the tokenizer."""
    kwargs = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
                  **kwargs)
    torch.manual_seed(0)
    model = model_cls(config_cls(**kwargs)).eval()
    path = os.path.join(str(root), name)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def make_opt(root, tokenizer, name="opt", **overrides) -> str:
    from transformers import OPTConfig, OPTForCausalLM
    kwargs = dict(hidden_size=64, ffn_dim=128, num_hidden_layers=3, num_attention_heads=4,
                  max_position_embeddings=512, word_embed_proj_dim=64,
                  do_layer_norm_before=True, activation_function="relu",
                  # Larger weights give peaked logits, so greedy choices are not near-ties.
                  init_std=0.3)
    return save_tiny(root, name, OPTConfig, OPTForCausalLM, tokenizer, **{**kwargs, **overrides})


def make_gpt2(root, tokenizer, name="gpt2", **overrides) -> str:
    from transformers import GPT2Config, GPT2LMHeadModel
    kwargs = dict(n_embd=64, n_inner=128, n_layer=3, n_head=4, n_positions=512,
                  activation_function="gelu_new", initializer_range=0.3)
    return save_tiny(root, name, GPT2Config, GPT2LMHeadModel, tokenizer,
                     **{**kwargs, **overrides})


def make_phi3(root, tokenizer, name="phi3", **overrides) -> str:
    from transformers import Phi3Config, Phi3ForCausalLM
    kwargs = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  original_max_position_embeddings=PHI3_ORIGINAL,
                  rope_parameters=dict(PHI3_ROPE), sliding_window=None, initializer_range=0.3)
    return save_tiny(root, name, Phi3Config, Phi3ForCausalLM, tokenizer,
                     **{**kwargs, **overrides})


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("models_basic")
    return {
        # opt-125m's layout: LayerNorm before each block, embedding as wide as the model.
        "opt_pre_ln": make_opt(root, tokenizer, "opt_pre_ln"),
        # opt-350m's: LayerNorm after each block, a narrower embedding with project_in/out.
        "opt_post_ln_proj": make_opt(root, tokenizer, "opt_post_ln_proj",
                                     do_layer_norm_before=False, word_embed_proj_dim=32),
        "opt_pre_ln_proj": make_opt(root, tokenizer, "opt_pre_ln_proj", word_embed_proj_dim=32),
        "gpt2": make_gpt2(root, tokenizer),
        "phi3_longrope": make_phi3(root, tokenizer, "phi3_longrope"),
        # Also a window shorter than prompt + output (Phi-3 windows every layer).
        "phi3_partial_rotary": make_phi3(root, tokenizer, "phi3_partial_rotary",
                                         rope_parameters={"rope_type": "default",
                                                          "rope_theta": 10000.0,
                                                          "partial_rotary_factor": 0.5},
                                         sliding_window=16),
    }


# -- the reference and the comparison ------------------------------------------------------------

def load_hf(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_generate(hf, prompt_ids: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens and, per step, the log-softmax of its raw logits."""
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids)),
                          max_new_tokens=n, min_new_tokens=n, do_sample=False, top_k=None,
                          top_p=None, pad_token_id=hf.config.eos_token_id, output_logits=True,
                          return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    return tokens, [torch.log_softmax(step[0].float(), -1) for step in out.logits]


def assert_top5_close(position: dict, ref: torch.Tensor, where: str) -> None:
    top = ref.topk(5)
    for tid, val in zip(top.indices.tolist(), top.values.tolist()):
        assert tid in position, f"{where}: transformers' top-5 token {tid} missing"
        assert position[tid].logprob == pytest.approx(val, abs=1e-3), where


def assert_all_blocks_free(llm: LLM) -> None:
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(c == 0 for c in bm.ref_counts)


def assert_matches_transformers(path: str, prompts=PROMPTS, **engine_kwargs) -> None:
    llm = LLM(path, num_gpu_blocks_override=64, **engine_kwargs)
    hf = load_hf(path)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        tokens, logprobs = hf_generate(hf, out.prompt_token_ids, NUM_TOKENS)
        assert out.outputs[0].token_ids == tokens, prompt
        for i, (position, ref) in enumerate(zip(out.outputs[0].logprobs, logprobs)):
            assert_top5_close(position, ref, f"{prompt!r} step {i}")
    assert_all_blocks_free(llm)


# -- correctness against transformers ------------------------------------------------------------

@pytest.mark.parametrize("name", ["opt_pre_ln", "opt_post_ln_proj", "opt_pre_ln_proj"])
def test_opt_matches_transformers(models, name):
    assert_matches_transformers(models[name])


def test_gpt2_matches_transformers(models):
    assert_matches_transformers(models["gpt2"])


def test_phi3_partial_rotary_matches_transformers(models):
    assert_matches_transformers(models["phi3_partial_rotary"])


def test_phi3_longrope_short_factors_when_max_model_len_fits(models):
    """max_model_len <= original_max_position_embeddings: no sequence can cross it, so both
    engines use the short factors throughout (prompt + 32 tokens stays inside 48)."""
    assert_matches_transformers(models["phi3_longrope"], max_model_len=PHI3_ORIGINAL)


FILLER = ("In the morning the market opens early, the bakers light their ovens and the "
          "streets fill with carts, bicycles and the smell of fresh bread. ")


def test_phi3_longrope_long_factors_for_prompts_past_the_original_length(models, tokenizer):
    """Prompts longer than original_max_position_embeddings: transformers encodes them, and
    every following step, with the long factors and the attention factor, as pagedlm does
    whenever max_model_len exceeds the original length."""
    prompts = [FILLER * 2 + p for p in PROMPTS]
    assert all(len(tokenizer.encode(p)) > PHI3_ORIGINAL for p in prompts)
    assert_matches_transformers(models["phi3_longrope"], prompts=prompts)


def test_phi3_longrope_crossing_the_original_length(models):
    """Prompts shorter than original_max_position_embeddings whose 32 tokens cross it.
    transformers uses the short factors while the sequence fits in the original length, then
    discards its cache and re-encodes the whole sequence with the long factors; pagedlm
    (max_model_len 256 > 48) uses the long factors throughout (layers/rotary_embedding.py says
    why). So every step at which the sequence is longer than the original length must equal
    transformers over the same tokens; the earlier ones differ from its short factors (which
    also shows the two sets really differ here)."""
    path = models["phi3_longrope"]
    llm = LLM(path, num_gpu_blocks_override=64)
    hf = load_hf(path)
    prompts = [FILLER + p for p in PROMPTS]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    crossed = 0
    for prompt, out in zip(prompts, outs):
        n = len(out.prompt_token_ids)
        assert n < PHI3_ORIGINAL < n + NUM_TOKENS - 1, "the sequence must cross within 32 tokens"
        ids = out.prompt_token_ids + out.outputs[0].token_ids
        with torch.inference_mode():
            # One forward pass each: transformers' longrope picks the factor set by the length
            # of the sequence it is given.
            long_ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
            short_ref = torch.log_softmax(
                hf(torch.tensor([ids[:PHI3_ORIGINAL]])).logits[0].float(), -1)
        short_diff = 0.0
        for i, position in enumerate(out.outputs[0].logprobs):
            length = n + i  # the sequence's length when this step's token was chosen
            if length > PHI3_ORIGINAL:
                assert_top5_close(position, long_ref[length - 1], f"{prompt!r} step {i}")
                crossed += 1
            else:
                short_diff = max(short_diff, max(abs(lp.logprob - short_ref[length - 1, t].item())
                                                 for t, lp in position.items()))
        assert short_diff > 1e-2, prompt
    assert crossed == sum(len(o.prompt_token_ids) + NUM_TOKENS - PHI3_ORIGINAL - 1 for o in outs)
    assert_all_blocks_free(llm)


# -- configuration errors ------------------------------------------------------------------------

def with_config(path: str, dst, **changes) -> str:
    """A copy of the model dir whose config.json has `changes` applied (weights linked)."""
    dst = str(dst)
    os.makedirs(dst)
    for f in os.listdir(path):
        if f != "config.json":
            os.symlink(os.path.join(path, f), os.path.join(dst, f))
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config.update(changes)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return dst


@pytest.mark.parametrize("name,field", [("opt_pre_ln", "activation_function"),
                                        ("gpt2", "activation_function"),
                                        ("phi3_partial_rotary", "hidden_act")])
def test_unsupported_activation_is_a_value_error_naming_the_field(models, tmp_path, name,
                                                                  field):
    path = with_config(models[name], tmp_path / "bad", **{field: "quick_gelu"})
    with pytest.raises(ValueError, match=rf"{field} 'quick_gelu' is not supported"):
        LLM(path, num_gpu_blocks_override=8)


def test_wrong_fused_weight_shape_names_the_weight(models, tmp_path):
    """The fused checkpoint tensors are cut at load time; one of the wrong size is reported
    by its checkpoint name, not as a failed split deep in the loader."""
    path = with_config(models["phi3_partial_rotary"], tmp_path / "bad", num_key_value_heads=4)
    with pytest.raises(ValueError, match=r"weight 'model\.layers\.0\.self_attn\.qkv_proj\.weight'"):
        LLM(path, num_gpu_blocks_override=8)


def with_renamed_weights(path: str, dst, rename, extra: dict) -> str:
    """A copy of the model dir whose safetensors names are `rename(name)`, plus `extra`."""
    from safetensors.torch import load_file, save_file
    dst = str(dst)
    os.makedirs(dst)
    for f in os.listdir(path):
        if not f.endswith(".safetensors"):
            os.symlink(os.path.join(path, f), os.path.join(dst, f))
    tensors = {rename(k): v for k, v in load_file(os.path.join(path, "model.safetensors")).items()}
    save_file({**tensors, **extra}, os.path.join(dst, "model.safetensors"))
    return dst


def _original_gpt2_names(name: str) -> str:
    return name.removeprefix("transformer.")


def _original_opt_names(name: str) -> str:
    return name.removeprefix("model.")


@pytest.mark.parametrize("name,rename,extra", [
    # openai-community/gpt2 names its tensors without "transformer." and stores each layer's
    # causal mask as attn.bias / attn.masked_bias buffers.
    ("gpt2", _original_gpt2_names,
     {f"h.{i}.attn.{b}": torch.tril(torch.ones(1, 1, 8, 8)) for i in range(3)
      for b in ("bias", "masked_bias")}),
    # facebook/opt-* checkpoints name their tensors "decoder.*".
    ("opt_pre_ln", _original_opt_names, {}),
])
def test_original_checkpoint_names_load(models, tmp_path, name, rename, extra):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    ref = LLM(models[name], num_gpu_blocks_override=16).generate(PROMPTS[:2], params,
                                                                 use_tqdm=False)
    path = with_renamed_weights(models[name], tmp_path / "orig", rename, extra)
    got = LLM(path, num_gpu_blocks_override=16).generate(PROMPTS[:2], params, use_tqdm=False)
    for r, g in zip(ref, got):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids
        assert [{t: lp.logprob for t, lp in pos.items()} for pos in g.outputs[0].logprobs] == \
            [{t: lp.logprob for t, lp in pos.items()} for pos in r.outputs[0].logprobs]


# -- tensor and pipeline parallelism (worker processes) ------------------------------------------

def run(path: str, **engine_kwargs):
    with LLM(path, num_gpu_blocks_override=64, **engine_kwargs) as llm:
        outs = [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert_all_blocks_free(llm)
    return outs


def assert_no_workers_left(timeout: float = 10.0) -> None:
    def alive():
        return [p for p in psutil.Process().children(recursive=True)
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                and "resource_tracker" not in " ".join(_cmdline(p))]
    deadline = time.monotonic() + timeout
    while (left := alive()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"worker processes left behind: {left}"


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


@pytest.mark.slow
@pytest.mark.parametrize("name,layouts", [
    ("opt_post_ln_proj", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)]),
    ("gpt2", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)]),
    ("phi3_longrope", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)]),
])
def test_tp_and_pp_match_one_worker(models, name, layouts):
    ref = run(models[name])
    for layout in layouts:
        got = run(models[name], distributed_executor_backend="mp", **layout)
        # Shards sum in another order: the same tokens up to a near-tie, logprobs to there.
        assert_greedy_logprobs_match(ref, got)
    assert_no_workers_left()
