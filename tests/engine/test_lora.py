"""Multi-LoRA: pagedlm with PEFT adapters against transformers + peft, batching of several
adapters, adapter slots and the adapter cache, prefix-cache separation, bad adapters."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedlm import LLM, LoRARequest, SamplingParams
from tests.compare_utils import assert_greedy_logprobs_match, assert_greedy_outputs_match
from tests.conftest import make_tiny_model
from tests.models.test_correctness import PROMPTS, hf_greedy

ALL_PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NUM_TOKENS = 32
# Runs in other batches, engines or cache states are compared up to a near-tie
# (tests/compare_utils.py): logprobs=2 tells one.
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=2)


def make_adapter(base_path: str, out: str, targets, r: int = 8, alpha: int = 16, seed: int = 1,
                 use_rslora: bool = False, safe: bool = True, **extra) -> str:
    """A random PEFT LoRA adapter for the model at base_path (B non-zero, so outputs change)."""
    import peft
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    torch.manual_seed(seed)
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets,
                          init_lora_weights=False, use_rslora=use_rslora, **extra)
    peft.get_peft_model(base, cfg).save_pretrained(out, safe_serialization=safe)
    return out


def peft_model(base_path: str, adapter_path: str):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_path).eval()


def check_against_peft(llm: LLM, ref, lora: LoRARequest | None, prompts=PROMPTS) -> None:
    """Greedy tokens identical on >= 7 of 8 prompts and top-5 logprobs within 2e-3."""
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
    same = 0
    for prompt, out in zip(prompts, outs):
        ids = tok.encode(prompt)
        got = out.outputs[0].token_ids
        same += got == hf_greedy(ref, tok, ids, NUM_TOKENS, ignore_eos=True)
        with torch.inference_mode():
            logp = torch.log_softmax(ref(torch.tensor([ids + got])).logits[0].float(), -1)
        for i, position in enumerate(out.outputs[0].logprobs):
            top = logp[len(ids) - 1 + i].topk(6)
            sixth = top.values[5].item()
            for tid, val in zip(top.indices[:5].tolist(), top.values[:5].tolist()):
                if tid not in position:
                    # Only a near-tie with the reference's 6th token may swap places.
                    assert val - sixth <= 2e-3, (prompt, i, tid, val, sixth)
                    continue
                assert position[tid].logprob == pytest.approx(val, abs=2e-3), (prompt, i)
    assert same >= len(prompts) - 1, f"only {same} of {len(prompts)} prompts identical"


def token_ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def firsts(outs):
    return [o.outputs[0] for o in outs]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_model_dir):
    """A tiny random Llama and three adapters: all projections (r 8), q/v only (r 4), and
    MLP + o_proj with rslora (r 8)."""
    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_model(root, "llama", default_model_dir)
    adapters = [
        make_adapter(base, str(root / "all"), ALL_PROJ, seed=1),
        make_adapter(base, str(root / "qv"), ["q_proj", "v_proj"], r=4, alpha=8, seed=2),
        make_adapter(base, str(root / "mlp"), ["gate_proj", "up_proj", "down_proj", "o_proj"],
                     seed=3, use_rslora=True),
    ]
    loras = [LoRARequest(f"a{i + 1}", i + 1, p) for i, p in enumerate(adapters)]
    return base, loras, root


@pytest.fixture(scope="module")
def tiny_llm(tiny):
    base, _, _ = tiny
    return LLM(base, enable_lora=True, max_loras=3, max_lora_rank=8, num_gpu_blocks_override=128)


# -- numerics against transformers + peft -------------------------------------------------------

@pytest.mark.parametrize("which", [0, 1, 2])
def test_tiny_llama_adapters_match_peft(tiny, tiny_llm, which):
    base, loras, _ = tiny
    check_against_peft(tiny_llm, peft_model(base, loras[which].lora_path), loras[which])
    # The adapter really changes the output (else the comparison above proves nothing).
    with_lora = token_ids(tiny_llm.generate(PROMPTS, GREEDY, use_tqdm=False,
                                            lora_request=loras[which]))
    assert with_lora != token_ids(tiny_llm.generate(PROMPTS, GREEDY, use_tqdm=False))


def test_bin_adapter_matches_safetensors(tiny, tiny_llm):
    base, loras, root = tiny
    path = make_adapter(base, str(root / "bin"), ALL_PROJ, seed=1, safe=False)
    assert os.path.isfile(os.path.join(path, "adapter_model.bin"))
    from_bin = tiny_llm.generate(PROMPTS[:4], GREEDY, use_tqdm=False,
                                 lora_request=LoRARequest("bin", 10, path))
    from_st = tiny_llm.generate(PROMPTS[:4], GREEDY, use_tqdm=False, lora_request=loras[0])
    assert_greedy_outputs_match(firsts(from_st), firsts(from_bin))


def test_default_model_adapter_matches_peft(tmp_path, default_model_dir):
    path = make_adapter(default_model_dir, str(tmp_path / "smol"), ALL_PROJ, seed=4)
    llm = LLM(enable_lora=True, max_lora_rank=8, kv_cache_memory_bytes=256 * 2**20)
    check_against_peft(llm, peft_model(default_model_dir, path), LoRARequest("smol", 1, path))


# -- batching, slots, the adapter cache ---------------------------------------------------------

def test_mixed_batch_equals_each_adapter_alone(tiny, tiny_llm):
    _, loras, _ = tiny
    choice = [None, loras[0], loras[1], None, loras[1], loras[0], None, loras[0]]
    mixed = firsts(tiny_llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=choice))
    alone = [firsts(tiny_llm.generate([p], GREEDY, use_tqdm=False, lora_request=c))[0]
             for p, c in zip(PROMPTS, choice)]
    assert_greedy_outputs_match(alone, mixed)
    # Different adapters do give different outputs on the same prompt.
    assert alone[0].token_ids != alone[1].token_ids != alone[2].token_ids


def _scaled_adapter(src: str, out: str, value: float) -> str:
    """src's adapter with every lora_A entry set to +-value (inf, nan, or a finite value large
    enough that x @ A^T overflows)."""
    import shutil

    from safetensors.torch import load_file, save_file
    shutil.copytree(src, out)
    st = os.path.join(out, "adapter_model.safetensors")
    tensors = load_file(st)
    for key in tensors:
        if ".lora_A." in key:
            tensors[key] = torch.sign(tensors[key]) * value
    save_file(tensors, st)
    return out


def test_an_overflowing_adapter_leaves_the_other_rows_of_its_batch_alone(tiny, tiny_llm,
                                                                          tmp_path):
    """The slots' deltas are computed for every token together: with a 0/1 mask, 0 x inf made
    the base model's rows NaN beside an adapter whose A overflowed (a hostile probe's finding:
    empty outputs at logprob -9999, kept in the prefix cache). Non-finite weights are refused."""
    _, loras, _ = tiny
    huge = LoRARequest("huge", 90, _scaled_adapter(loras[0].lora_path, str(tmp_path / "huge"),
                                                  3e38))
    choice = [None, huge, None, huge]
    prompts = PROMPTS[:4]
    mixed = firsts(tiny_llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=choice))
    alone = firsts(tiny_llm.generate([prompts[0], prompts[2]], GREEDY, use_tqdm=False))
    assert_greedy_outputs_match(alone, [mixed[0], mixed[2]])
    for i, value in enumerate((float("nan"), float("inf"))):
        bad = LoRARequest(f"bad{i}", 91 + i, _scaled_adapter(loras[0].lora_path,
                                                     str(tmp_path / f"bad-{value}"), value))
        with pytest.raises(ValueError, match="NaN or infinite"):
            tiny_llm.generate(prompts[:1], GREEDY, use_tqdm=False, lora_request=bad)


def test_one_slot_three_adapters_take_turns(tiny, tiny_llm):
    base, loras, _ = tiny
    choice = [loras[i % 3] for i in range(6)]
    expected = firsts(tiny_llm.generate(PROMPTS[:6], GREEDY, use_tqdm=False,
                                        lora_request=choice))
    one = LLM(base, enable_lora=True, max_loras=1, max_cpu_loras=3, max_lora_rank=8,
              num_gpu_blocks_override=128)
    got = firsts(one.generate(PROMPTS[:6] + ["Hello there"], GREEDY, use_tqdm=False,
                              lora_request=choice + [None]))
    assert_greedy_outputs_match(expected, got[:6])
    stats = one.llm_engine.stats.scheduler
    assert stats.max_step_loras == 1
    assert stats.num_lora_waits > 0
    assert one.llm_engine.lora_stats().num_slot_loads >= 3


def test_cpu_cache_of_two_evicts_and_reloads(tiny, tiny_llm):
    base, loras, _ = tiny
    expected = [firsts(tiny_llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False,
                                         lora_request=lora)) for lora in loras]
    small = LLM(base, enable_lora=True, max_loras=1, max_cpu_loras=2, max_lora_rank=8,
                num_gpu_blocks_override=128)
    for _ in range(2):  # the second round needs the evicted adapters again
        for lora, exp in zip(loras, expected):
            assert_greedy_outputs_match(exp, firsts(small.generate(
                PROMPTS[:2], GREEDY, use_tqdm=False, lora_request=lora)))
    stats = small.llm_engine.lora_stats()
    assert len(stats.cached_ids) == 2
    assert stats.num_evictions >= 4
    assert stats.num_loads == 3 + stats.num_evictions - 1
    assert [r.lora_int_id for r in small.llm_engine.list_loras()] == [1, 2, 3]


def test_prefix_cache_is_not_shared_between_adapters(tiny):
    base, loras, _ = tiny
    llm = LLM(base, enable_lora=True, max_loras=2, max_lora_rank=8, num_gpu_blocks_override=128)
    bm = llm.llm_engine.block_manager
    prompt = " ".join(["word"] * 70)  # several full blocks
    params = SamplingParams(temperature=0, max_tokens=2, logprobs=2)
    first = llm.generate(prompt, params, use_tqdm=False, lora_request=loras[0])[0]
    other = llm.generate(prompt, params, use_tqdm=False, lora_request=loras[1])[0]
    base_run = llm.generate(prompt, params, use_tqdm=False)[0]
    assert bm.prefix_hits == 0  # each adapter (and the base model) computed every block
    assert first.num_cached_tokens == other.num_cached_tokens == base_run.num_cached_tokens == 0
    again = llm.generate(prompt, params, use_tqdm=False, lora_request=loras[1])[0]
    assert again.num_cached_tokens >= 64  # the same adapter does reuse its blocks
    assert_greedy_outputs_match(other.outputs, again.outputs)  # a cache hit: up to a near-tie


def test_remove_lora_frees_it_everywhere(tiny):
    base, loras, _ = tiny
    llm = LLM(base, enable_lora=True, max_lora_rank=8, num_gpu_blocks_override=64)
    engine = llm.llm_engine
    assert engine.add_lora(loras[0]) is True
    assert engine.add_lora(loras[0]) is False
    assert engine.lora_stats().cached_ids == [1]
    assert engine.remove_lora(1) is True
    assert engine.remove_lora(1) is False
    assert engine.list_loras() == [] and engine.lora_stats().cached_ids == []


# -- bad input ----------------------------------------------------------------------------------

def _bad_input_cases(tiny, tmp_path, default_model_dir):
    base, loras, _ = tiny
    other = make_tiny_model(tmp_path / "wide", "llama", default_model_dir, hidden_size=96)
    cases = {
        "missing path": (LoRARequest("x", 7, str(tmp_path / "nope")), "lora_path"),
        "rank too large": (LoRARequest("x", 7, make_adapter(base, str(tmp_path / "r16"),
                                                             ["q_proj"], r=16)),
                           "max_lora_rank"),
        "lm_head": (LoRARequest("x", 7, make_adapter(base, str(tmp_path / "head"),
                                                      ["lm_head"])), "lm_head"),
        "embedding": (LoRARequest("x", 7, make_adapter(base, str(tmp_path / "emb"),
                                                        ["embed_tokens"])), "embed_tokens"),
        "shapes": (LoRARequest("x", 7, make_adapter(other, str(tmp_path / "wide_a"),
                                                     ["q_proj"])), "shape"),
        "id reused": (LoRARequest("other", 1, loras[1].lora_path), "lora_int_id 1"),
    }
    # A scaling that is not a finite float32 would reach every token batched with the adapter
    # (the slots' deltas are computed together): these were loaded, and broke the base model's
    # tokens in the same steps.
    edits = {"config a list": (lambda c: [c], "JSON object"),
             "alpha NaN": (lambda c: {**c, "lora_alpha": float("nan")}, "lora_alpha"),
             "alpha infinite": (lambda c: {**c, "lora_alpha": float("inf")}, "lora_alpha"),
             "alpha a string": (lambda c: {**c, "lora_alpha": "16"}, "lora_alpha"),
             "alpha overflows": (lambda c: {**c, "lora_alpha": 1e300}, "overflows float32"),
             "alpha past floats": (lambda c: {**c, "lora_alpha": 10**400}, "lora_alpha"),
             "rank a bool": (lambda c: {**c, "r": True}, "rank r=True"),
             "rslora a string": (lambda c: {**c, "use_rslora": "no"}, "use_rslora"),
             "bias in a list": (lambda c: {**c, "bias": ["all"]}, "bias")}
    for i, (case, (edit, field)) in enumerate(edits.items()):
        path = str(tmp_path / f"edited{i}")
        shutil.copytree(loras[0].lora_path, path)
        with open(os.path.join(path, "adapter_config.json")) as f:
            cfg = json.load(f)
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump(edit(cfg), f)
        cases[case] = (LoRARequest("x", 7, path), field)
    # Rank-0 tensors (a ZeroDivisionError in the scaling, a 500 over the server).
    path = str(tmp_path / "rank0")
    shutil.copytree(loras[0].lora_path, path)
    weights = os.path.join(path, "adapter_model.safetensors")
    save_file({k: v[:0] if ".lora_A." in k else v[:, :0] for k, v in load_file(weights).items()},
              weights)
    cases["rank 0"] = (LoRARequest("x", 7, path), "rank 0")
    return cases


def test_bad_adapters_are_refused_and_leave_nothing_behind(tiny, tmp_path, default_model_dir):
    base, loras, _ = tiny
    llm = LLM(base, enable_lora=True, max_lora_rank=8, max_cpu_loras=4,
              num_gpu_blocks_override=64)
    engine = llm.llm_engine
    engine.add_lora(loras[0])
    for case, (lora, field) in _bad_input_cases(tiny, tmp_path, default_model_dir).items():
        with pytest.raises(ValueError, match=field):
            llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, lora_request=lora)
        assert [r.lora_int_id for r in engine.list_loras()] == [1], case
        assert engine.lora_stats().cached_ids == [1], case
        assert not engine.has_unfinished_requests(), case
    # The engine still serves the registered adapter after all that.
    assert llm.generate(PROMPTS[0], GREEDY, use_tqdm=False, lora_request=loras[0])


def test_lora_disabled_or_bad_settings(tiny):
    base, loras, _ = tiny
    llm = LLM(base, num_gpu_blocks_override=32)
    with pytest.raises(ValueError, match="enable_lora"):
        llm.generate(PROMPTS[0], GREEDY, use_tqdm=False, lora_request=loras[0])
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LLM(base, enable_lora=True, max_loras=3, max_cpu_loras=2)
    with pytest.raises(ValueError, match="max_lora_rank"):
        LLM(base, enable_lora=True, max_lora_rank=0)
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, "/tmp")
    with pytest.raises(ValueError, match="lora_request has 1 entries"):
        llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, lora_request=[None])
    # A path given for the request: it was read as a list of 12 letters.
    with pytest.raises(ValueError, match="lora_request must be a LoRARequest.*got str"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=loras[0].lora_path)


def test_unsupported_peft_features_are_named(tiny, tmp_path):
    base, _, _ = tiny
    llm = LLM(base, enable_lora=True, max_lora_rank=8, num_gpu_blocks_override=32)
    path = make_adapter(base, str(tmp_path / "dora"), ["q_proj"], use_dora=True)
    with pytest.raises(ValueError, match="use_dora"):
        llm.llm_engine.add_lora(LoRARequest("dora", 3, path))
    os.remove(os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json")) as f:
        cfg = json.load(f)
    cfg["use_dora"] = False
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="neither adapter_model.safetensors"):
        llm.llm_engine.add_lora(LoRARequest("dora", 3, path))
    assert llm.llm_engine.list_loras() == []


# -- tensor parallelism -------------------------------------------------------------------------

@pytest.mark.slow
def test_tensor_parallel_2_equals_1(tmp_path, default_model_dir):
    """Column layers shard B, row layers shard A; one KV head (replicated over the two ranks)
    exercises the QKV loader's replication for B's k and v rows."""
    from tests.distributed.test_distributed_executor import assert_no_workers_left
    base = make_tiny_model(tmp_path, "llama", default_model_dir, num_key_value_heads=1)
    loras = [LoRARequest("all", 1, make_adapter(base, str(tmp_path / "all"), ALL_PROJ)),
             LoRARequest("qv", 2, make_adapter(base, str(tmp_path / "qv"), ["q_proj", "v_proj",
                                                                             "down_proj"], r=4))]
    choice = [loras[0], None, loras[1], loras[0], loras[1], None]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
    results = {}
    for tp in (1, 2):
        llm = LLM(base, enable_lora=True, max_loras=2, max_lora_rank=8,
                  num_gpu_blocks_override=64, tensor_parallel_size=tp,
                  distributed_executor_backend="mp" if tp > 1 else None)
        results[tp] = llm.generate(PROMPTS[:6], params, use_tqdm=False, lora_request=choice)
        llm.shutdown()
    assert_no_workers_left()
    assert_greedy_logprobs_match(firsts(results[1]), firsts(results[2]), atol=1e-4)


def test_an_adapter_deleted_on_disk_fails_only_its_own_requests(tiny, tmp_path):
    """Adapters whose files change after they were loaded: an adapter with unfinished requests
    stays loaded however many others arrive (a step loaded an evicted one again from its files,
    and a failure there failed the engine and every request in the step), and one evicted
    while idle is loaded again when a request arrives, where a failure refuses that request."""
    base, loras, _ = tiny
    a, b = (LoRARequest(f"copy{i}", 20 + i,
                        shutil.copytree(lora.lora_path, str(tmp_path / f"c{i}")))
            for i, lora in enumerate(loras[:2]))
    llm = LLM(base, enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=8,
              num_gpu_blocks_override=128)
    engine = llm.llm_engine
    expected = {lora.lora_name: firsts(llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False,
                                                    lora_request=lora)) for lora in (a, b)}
    # a in use; b's load (one CPU slot) must not evict it; then a's files go.
    engine.add_request("ra", PROMPTS[0], GREEDY, lora_request=a)
    engine.add_request("rb", PROMPTS[1], GREEDY, lora_request=b)
    shutil.rmtree(a.lora_path)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o) for o in engine.step() if o.finished)
    assert_greedy_outputs_match(expected["copy0"][:1], [outs["ra"].outputs[0]])
    assert_greedy_outputs_match(expected["copy1"][1:], [outs["rb"].outputs[0]])
    # Idle now, a is evicted by another adapter's load; asked for again, it is refused alone.
    llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=loras[2])
    with pytest.raises(ValueError, match="could not be loaded again.*not a directory"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=a)
    assert not engine.has_unfinished_requests()
    assert_greedy_outputs_match(expected["copy1"], firsts(
        llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, lora_request=b)))
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_an_eviction_interrupted_midway_leaves_no_half_slot(tiny, tiny_llm):
    """A Ctrl-C while loading an adapter evicts another from its device slot, the slot zeroed
    layer by layer: the slot was still marked as the evicted adapter's, which then ran on the
    half-zeroed weights (wrong tokens, for good, no error). Here the 3rd layer's write raises."""
    from pagedlm.lora.layers import BaseLayerWithLoRA
    base, loras, _ = tiny
    want = firsts(tiny_llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, lora_request=loras[0]))
    small = LLM(base, enable_lora=True, max_loras=2, max_cpu_loras=2, max_lora_rank=8,
                num_gpu_blocks_override=128)
    for lora in loras[:2]:  # both slots and the cache hold adapters 1 and 2
        small.generate(PROMPTS[:2], GREEDY, use_tqdm=False, lora_request=lora)
    real, calls = BaseLayerWithLoRA.set_slot, []

    def set_slot(self, slot, weights):
        calls.append(weights is None)
        if len(calls) == 3:
            raise KeyboardInterrupt
        real(self, slot, weights)

    BaseLayerWithLoRA.set_slot = set_slot
    try:
        with pytest.raises(KeyboardInterrupt):
            small.llm_engine.add_lora(loras[2])  # evicts adapter 1, the least recently used
    finally:
        BaseLayerWithLoRA.set_slot = real
    assert calls[:3] == [True] * 3  # interrupted while zeroing the evicted adapter's slot
    for _ in range(2):
        assert_greedy_outputs_match(want, firsts(small.generate(
            PROMPTS[:2], GREEDY, use_tqdm=False, lora_request=loras[0])))
    small.shutdown()
