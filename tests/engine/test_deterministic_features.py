"""deterministic=True (issue 31) beyond a dense model's plain requests: mixture-of-experts
models, LoRA adapters, structured outputs, n=2 seeded sampling and other architectures. Each
probe request run alone gives bitwise the token ids and logprobs (its chosen tokens' and its
top-3) it gives in a batch of about 20 mixed requests, run by an engine that prefills in
chunks of a small token budget and has prefix caching on (a second engine, but for structured
outputs). Also the MoE and LoRA pieces on their own: a token's result does not depend on the
other rows."""
from __future__ import annotations

import random

import pytest
import torch

from pagedlm import LLM, LoRARequest, SamplingParams
from pagedlm.lora.layers import ColumnParallelLinearWithLoRA, LoRABatch
from pagedlm.model_executor.layers.activation import GeluAndMul, get_act_fn
from pagedlm.model_executor.layers.fused_moe import FusedMoE, Routing, sigmoid_per_element
from pagedlm.model_executor.layers.linear import ColumnParallelLinear
from pagedlm.sampling_params import StructuredOutputsParams
from tests.conftest import make_tiny_model, needs_kernels

pytestmark = needs_kernels  # the mode runs on the native kernels

WORDS = ("the river town market bread green stone window quiet seven blue morning letter "
         "garden train paper silver winter road music table orange cloud bridge north "
         "candle forest simple yellow horse mirror school island coffee doctor engine").split()
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3)
SEEDED = SamplingParams(temperature=1.0, seed=11, max_tokens=4, ignore_eos=True, logprobs=3)
N2 = SamplingParams(temperature=0.8, top_p=0.9, seed=5, n=2, max_tokens=4, ignore_eos=True,
                    logprobs=3)
# The batched engine: prompts prefilled in chunks, a few sequences at a time.
BATCHED = dict(max_num_batched_tokens=24, max_num_seqs=6, enable_prefix_caching=True)


def _prompt(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def _background(rng: random.Random, n: int) -> list[SamplingParams]:
    """Other requests' parameters: greedy, seeded, unseeded, n=2, with and without top-k/p,
    penalties and logprobs."""
    out = []
    for _ in range(n):
        kind = rng.choice(["greedy", "seeded", "unseeded", "n2", "penalised"])
        kw = dict(max_tokens=rng.randint(1, 6), ignore_eos=True,
                  logprobs=rng.choice([None, 0, 2]))
        if kind == "greedy":
            out.append(SamplingParams(temperature=0, **kw))
        elif kind == "seeded":
            out.append(SamplingParams(temperature=0.7, top_k=20, seed=rng.randint(0, 99), **kw))
        elif kind == "unseeded":
            out.append(SamplingParams(temperature=1.2, min_p=0.05, **kw))
        elif kind == "n2":
            out.append(SamplingParams(temperature=1.0, n=2, seed=rng.randint(0, 99), **kw))
        else:
            out.append(SamplingParams(temperature=0.9, seed=3, repetition_penalty=1.3,
                                      frequency_penalty=0.5, presence_penalty=0.2, **kw))
    return out


def _result(out) -> list:
    """Every sequence's (token ids, {token: logprob} per position)."""
    return [(list(c.token_ids),
             [{t: lp.logprob for t, lp in pos.items()} for pos in c.logprobs or []])
            for c in out.outputs]


def assert_alone_equals_batched(path: str, probes: list[tuple[str, SamplingParams, object]],
                                seed: int = 0, background_params=None, loras=(None,),
                                batched: dict | None = BATCHED, **engine_kwargs) -> None:
    """Each probe (prompt, params, lora request) alone on one engine, then all of them in a
    batch of about 20 with background requests (of random loras) on another, with the engine
    settings `batched` (None: on the same engine, its prefix cache warm): bitwise equal."""
    llm = LLM(path, deterministic=True, **engine_kwargs)
    alone = [_result(llm.generate([p], [sp], use_tqdm=False,
                                  lora_request=[lr] if lr else None)[0])
             for p, sp, lr in probes]
    if batched is not None:
        del llm
        llm = LLM(path, deterministic=True, **{**engine_kwargs, **batched})
    rng = random.Random(seed)
    params = background_params or _background(rng, 20 - len(probes))
    batch = [(_prompt(rng, rng.randint(3, 40)), sp, rng.choice(loras)) for sp in params]
    where = sorted(rng.sample(range(len(batch) + len(probes)), len(probes)))
    for i, probe in zip(where, probes):
        batch.insert(i, probe)
    lora_requests = [lr for _, _, lr in batch]
    outs = llm.generate([p for p, _, _ in batch], [sp for _, sp, _ in batch], use_tqdm=False,
                        lora_request=lora_requests if any(lora_requests) else None)
    for i, expected in zip(where, alone):
        assert _result(outs[i]) == expected, f"probe at {i} of {len(batch)}"


def _probes(rng_seed: int = 1, loras=(None,)) -> list[tuple[str, SamplingParams, object]]:
    rng = random.Random(rng_seed)
    return [(_prompt(rng, n), sp, loras[i % len(loras)])
            for i, (n, sp) in enumerate([(30, GREEDY), (9, SEEDED), (21, N2), (45, SEEDED)])]


# -- mixture of experts ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def arch_models(tmp_path_factory, default_model_dir):
    from tests.models.test_moe import make_tiny_moe_model
    root = tmp_path_factory.mktemp("det_archs")
    return lambda arch: make_tiny_moe_model(root / arch, arch, default_model_dir)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_moe_models_alone_equal_batched(arch_models, arch):
    assert_alone_equals_batched(arch_models(arch), _probes(), num_gpu_blocks_override=128)


def _moe_layer(deterministic: bool) -> FusedMoE:
    moe = FusedMoE(num_experts=5, hidden_size=64, intermediate_size=40,
                   deterministic=deterministic)
    g = torch.Generator().manual_seed(0)
    moe.w13_weight.data.copy_(torch.randn(moe.w13_weight.shape, generator=g) * 0.1)
    moe.w2_weight.data.copy_(torch.randn(moe.w2_weight.shape, generator=g) * 0.1)
    moe.process_weights_after_loading()
    return moe


def _routing(logits: torch.Tensor, top_k: int = 3) -> Routing:
    weights, ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
    return Routing(ids, weights)


def test_fused_moe_rows_do_not_depend_on_the_batch():
    """Tokens alone and among 1..70 others (so every expert gets another row count): the
    same bits for every token, on 1 thread or 2. The default path is the same function up to
    rounding."""
    moe = _moe_layer(deterministic=True)
    g = torch.Generator().manual_seed(1)
    x, logits = torch.randn(70, 64, generator=g), torch.randn(70, 5, generator=g)
    full = moe(x, _routing(logits))
    for rows in (slice(0, 1), slice(3, 4), slice(5, 12), slice(20, 53)):
        assert torch.equal(moe(x[rows], _routing(logits[rows])), full[rows]), rows
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(moe(x, _routing(logits)), full)
    finally:
        torch.set_num_threads(threads)
    default = _moe_layer(deterministic=False)
    torch.testing.assert_close(default(x, _routing(logits)), full, rtol=1e-5, atol=1e-5)


def test_sigmoid_per_element_does_not_depend_on_the_batch():
    # Plain torch.sigmoid gives the vector blocks and the leftover elements different bits.
    x = torch.randn(45, 1, generator=torch.Generator().manual_seed(2)) * 3
    full = sigmoid_per_element(x)
    assert all(torch.equal(sigmoid_per_element(x[i:i + 1]), full[i:i + 1]) for i in range(45))
    torch.testing.assert_close(full, torch.sigmoid(x), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["gelu_new", "gelu", "silu"])
def test_activations_under_the_switch_do_not_depend_on_the_batch(name):
    # GPT-2's gelu_new, unwrapped, gives 34 of these 45 rows other bits alone than in the batch.
    x = torch.randn(45, 74, generator=torch.Generator().manual_seed(3)) * 3
    act = get_act_fn(name, deterministic=True)
    full = act(x)
    assert all(torch.equal(act(x[i:i + 1]), full[i:i + 1]) for i in range(45))
    torch.testing.assert_close(full, get_act_fn(name)(x), rtol=1e-6, atol=1e-6)
    gated = GeluAndMul("tanh", deterministic=True)
    both = torch.cat([x, x.flip(0)], dim=1)
    assert all(torch.equal(gated(both[i:i + 1]), gated(both)[i:i + 1]) for i in range(45))


# -- LoRA -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def lora_model(tmp_path_factory, default_model_dir):
    from tests.engine.test_lora import ALL_PROJ, make_adapter
    root = tmp_path_factory.mktemp("det_lora")
    base = make_tiny_model(root, "llama", default_model_dir)
    adapters = [make_adapter(base, str(root / "all"), ALL_PROJ, seed=1),
                make_adapter(base, str(root / "qv"), ["q_proj", "v_proj"], r=4, alpha=8,
                             seed=2)]
    return base, [LoRARequest(f"a{i + 1}", i + 1, p) for i, p in enumerate(adapters)]


def test_lora_mixed_adapters_alone_equal_batched(lora_model):
    base, loras = lora_model
    choices = (None, *loras)
    assert_alone_equals_batched(base, _probes(loras=choices), loras=choices, enable_lora=True,
                                max_loras=2, max_lora_rank=8, num_gpu_blocks_override=128)


def test_lora_delta_rows_do_not_depend_on_the_batch():
    """One column layer with adapters in slots 0 and 1: a token's output is the same bits
    alone and among 37 tokens of both adapters and none, whichever slot its adapter is in."""
    base = ColumnParallelLinear(32, 48, bias=False)
    g = torch.Generator().manual_seed(3)
    base.weight.data.copy_(torch.randn(48, 32, generator=g))
    base.linear_method.process_weights_after_loading(base)
    batch = LoRABatch(max_loras=2, deterministic=True)
    layer = ColumnParallelLinearWithLoRA(base, batch, max_lora_rank=4)
    adapters = [(torch.randn(4, 32, generator=g), torch.randn(4, 48, generator=g) * 0.1)
                for _ in range(2)]
    x = torch.randn(37, 32, generator=g)
    slots = torch.tensor([i % 3 - 1 for i in range(37)])  # -1 (none), 0, 1, ...

    def run(rows, first_adapter_slot: int):
        order = adapters if first_adapter_slot == 0 else adapters[::-1]
        for s, w in enumerate(order):
            layer.set_slot(s, w)
        s = slots[rows].clone()
        if first_adapter_slot == 1:
            s[s >= 0] = 1 - s[s >= 0]
        batch.set(s if bool((s >= 0).any()) else None)
        return layer(x[rows])

    full = run(slice(None), 0)
    for i in range(37):
        assert torch.equal(run(slice(i, i + 1), i % 2), full[i:i + 1]), i
    assert torch.equal(run(slice(None), 1), full)
    plain = LoRABatch(max_loras=2)
    default = ColumnParallelLinearWithLoRA(base, plain, max_lora_rank=4)
    for s, w in enumerate(adapters):
        default.set_slot(s, w)
    plain.set(slots)
    torch.testing.assert_close(default(x), full, rtol=1e-5, atol=1e-5)


# -- structured outputs and n > 1 (on the tiny Llama, which has SmolLM2's tokenizer) --------------

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"]}


def test_structured_outputs_and_n2_alone_equal_batched(lora_model):
    so = StructuredOutputsParams
    json_greedy = SamplingParams(temperature=0, max_tokens=6, logprobs=3,
                                 structured_outputs=so(json=SCHEMA))
    regex_seeded = SamplingParams(temperature=1.0, seed=4, max_tokens=6, logprobs=3,
                                  structured_outputs=so(regex=r"[a-z]{2,8}-[0-9]{1,4}"))
    json_n2 = SamplingParams(temperature=1.0, seed=9, n=2, max_tokens=5, logprobs=3,
                             structured_outputs=so(json=SCHEMA))
    rng = random.Random(5)
    probes = [("A person as JSON: ", json_greedy, None),
              ("A product code: ", regex_seeded, None),
              (_prompt(rng, 12), N2, None),
              ("Another person as JSON: ", json_n2, None)]
    background = _background(rng, 12) + [
        SamplingParams(temperature=0.5, seed=i, max_tokens=3, structured_outputs=so(
            choice=["yes", "no", "maybe"])) for i in range(3)] + [
        SamplingParams(temperature=0, max_tokens=4, structured_outputs=so(json=SCHEMA))]
    # One engine: each starts its own grammar compiler process, which takes minutes to start
    # on a loaded machine. Its prefill chunks are small and its prefix cache warm all the same.
    assert_alone_equals_batched(lora_model[0], probes, seed=5, background_params=background,
                                batched=None, num_gpu_blocks_override=128, **BATCHED)


# -- other architectures --------------------------------------------------------------------------

def _gemma2(root, default_model_dir):
    from transformers import Gemma2Config, Gemma2ForCausalLM
    from tests.models.test_gemma import GEMMA2
    from tests.models.test_sliding_window import make_hf_model
    return make_hf_model(root, "gemma2", Gemma2Config, Gemma2ForCausalLM, default_model_dir,
                         **GEMMA2)[0]


def _basic(maker):
    def make(root, default_model_dir):
        from transformers import AutoTokenizer
        return maker(root, AutoTokenizer.from_pretrained(default_model_dir))
    return make


def _arch_makers():
    from tests.models import test_models_basic as basic
    return {"gemma2": _gemma2, "phi3": _basic(basic.make_phi3), "gpt2": _basic(basic.make_gpt2),
            "opt": _basic(basic.make_opt)}


@pytest.mark.parametrize("arch", ["qwen3", "gemma2", "phi3", "gpt2", "opt"])
def test_other_architectures_alone_equal_batched(arch_models, tmp_path, default_model_dir,
                                                 arch):
    path = (arch_models(arch) if arch == "qwen3"
            else _arch_makers()[arch](tmp_path, default_model_dir))
    assert_alone_equals_batched(path, _probes(), num_gpu_blocks_override=128)


def test_models_built_without_the_loader_follow_the_switch(arch_models):
    """A model class built directly (no attention backend given) picks the deterministic
    backend from its config, as the loader does."""
    from pagedlm.engine.arg_utils import EngineArgs
    from pagedlm.model_executor.models.registry import get_model_class
    cfg = EngineArgs(model=arch_models("qwen2_moe"),
                     deterministic=True).create_engine_config().model_config
    with torch.device("meta"):
        model = get_model_class(cfg.architecture)(cfg)
    backends = {m.backend for m in model.modules() if hasattr(m, "backend")}
    assert backends and all(b.deterministic for b in backends)
    assert all(m.deterministic for m in model.modules() if isinstance(m, FusedMoE))
