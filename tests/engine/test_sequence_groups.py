"""Sequence groups: n > 1 and best_of share the prompt's blocks and copy on write; beam search,
built on the same forking, matches transformers' beam search."""
from __future__ import annotations

import pytest
import torch

from pagedlm import LLM, BeamSearchParams, SamplingParams
from tests.conftest import make_tiny_model


@pytest.fixture(scope="module")
def llm():
    return LLM(kv_cache_memory_bytes=128 * 2**20)


def test_n4_shares_the_prompt_blocks_and_copies_the_last_one_on_write(llm):
    engine = llm.llm_engine
    bm = engine.block_manager
    prompt = {"prompt_token_ids": list(range(1000, 1040))}  # 40 tokens: 2 full blocks + 8
    engine.add_request("n4", prompt, SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=8,
                                                    ignore_eos=True))
    engine.step()  # prefill once, sample 4 first tokens: the prompt forks into 4 sequences
    group = engine.requests["n4"]
    assert len(group.seqs) == 4
    tables = [s.block_table for s in group.seqs]
    assert all(t == tables[0] for t in tables) and len(tables[0]) == 3
    assert [bm.ref_counts[b] for b in tables[0]] == [4, 4, 4]
    assert bm.num_blocks - bm.num_free_blocks == 3  # the prompt's blocks, once
    engine.step()  # each writes its first token into the shared, half-full last block
    tables = [s.block_table for s in group.seqs]
    assert all(t[:2] == tables[0][:2] for t in tables)
    assert [bm.ref_counts[b] for b in tables[0][:2]] == [4, 4]
    assert len({t[2] for t in tables}) == 4  # three copies plus the original
    assert bm.num_blocks - bm.num_free_blocks == 2 + 4
    while engine.has_unfinished_requests():
        outs = engine.step()
    texts = {c.text for c in outs[0].outputs}
    assert len(outs[0].outputs) == 4 and len(texts) > 1  # the outputs diverged
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)


def test_best_of_returns_the_n_most_likely_of_its_samples(llm):
    prompt = "Write a word:"
    all4 = llm.generate(prompt, SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=6,
                                               logprobs=0), use_tqdm=False)[0]
    best = llm.generate(prompt, SamplingParams(n=2, best_of=4, temperature=1.0, seed=11,
                                               max_tokens=6), use_tqdm=False)[0]
    ranked = sorted(all4.outputs, key=lambda c: c.cumulative_logprob, reverse=True)[:2]
    assert [c.token_ids for c in best.outputs] == [c.token_ids for c in ranked]
    assert [c.cumulative_logprob for c in best.outputs] == pytest.approx(
        [c.cumulative_logprob for c in ranked], abs=1e-4)


def test_beam_search_parameters_are_validated():
    for kwargs, field in [(dict(temperature=0.7), "temperature"), (dict(top_k=5), "top_k"),
                          (dict(stop=["x"]), "stop"), (dict(best_of=2, n=3), "best_of")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(use_beam_search=True, **{"best_of": 4, "temperature": 0, **kwargs})


def test_beam_search_runs_above_the_engine(llm):
    """The engine refuses a beam request (run there it would be plain greedy decoding); LLM
    runs it as a search over the engine, which then holds nothing of it."""
    engine = llm.llm_engine
    params = SamplingParams(use_beam_search=True, n=2, temperature=0, max_tokens=3)
    with pytest.raises(ValueError, match="^use_beam_search"):
        engine.add_request("beam", "Hello", params)
    assert not engine.has_unfinished_requests()
    (out,) = llm.generate(["Hello"], params, use_tqdm=False)
    (beams,) = llm.beam_search(["Hello"], BeamSearchParams(beam_width=2, max_tokens=3))
    assert [list(out.prompt_token_ids) + c.token_ids for c in out.outputs] == [
        b.tokens for b in beams.sequences]
    assert not engine.has_unfinished_requests() and not engine.requests
    # A search wider than the step's logprobs allow is refused up front, naming the field
    # that set its width.
    wide = SamplingParams(use_beam_search=True, n=11, temperature=0, max_tokens=3)
    with pytest.raises(ValueError, match="^n "):
        llm.generate(["Hello"], wide, use_tqdm=False)
    wider = SamplingParams(use_beam_search=True, n=2, best_of=11, temperature=0, max_tokens=3)
    with pytest.raises(ValueError, match="^best_of "):
        llm.generate(["Hello"], wider, use_tqdm=False)
    assert not engine.has_unfinished_requests()


def hf_beams(model, ids: list[int], width: int, max_new: int, length_penalty: float):
    out = model.generate(torch.tensor([ids]),
                         attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         num_beams=width, num_return_sequences=width, do_sample=False,
                         max_new_tokens=max_new, length_penalty=length_penalty)
    return out.tolist()


def strip_padding(hf_seq: list[int], ours: list[int], pad: int) -> bool:
    """transformers pads shorter beams (they ended with EOS) with the pad/EOS id."""
    return hf_seq[:len(ours)] == ours and all(t == pad for t in hf_seq[len(ours):])


def test_beam_search_matches_transformers_on_a_tiny_model(tmp_path, default_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = make_tiny_model(tmp_path, "llama", default_model_dir)
    tiny = LLM(path, num_gpu_blocks_override=128)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    prompts = ["The quick brown fox", "Once upon a time in a land far away there"]
    for width in (2, 4):
        outs = tiny.beam_search(prompts, BeamSearchParams(beam_width=width, max_tokens=10))
        for prompt, out in zip(prompts, outs):
            expected = hf_beams(hf, tok(prompt).input_ids, width, 10, 1.0)
            assert [b.tokens for b in out.sequences] == expected
    bm = tiny.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)


@pytest.mark.parametrize("question,length_penalty", [("What is the capital of France?", 1.0),
                                                     ("Say hi.", 0.0)])
def test_beam_search_matches_transformers_with_eos(llm, hf_default_model, question,
                                                  length_penalty):
    tok = llm.get_tokenizer()
    pad = hf_default_model.generation_config.pad_token_id
    if pad is None:
        pad = tok.eos_token_id
    text = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                   add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    out = llm.beam_search([{"prompt_token_ids": ids}],
                          BeamSearchParams(beam_width=3, max_tokens=24,
                                           length_penalty=length_penalty))[0]
    expected = hf_beams(hf_default_model, ids, 3, 24, length_penalty)
    assert any(b.finish_reason == "stop" for b in out.sequences)  # EOS ended some beams
    assert len(out.sequences) == 3
    for ours, theirs in zip(out.sequences, expected):
        assert strip_padding(theirs, ours.tokens, pad)
