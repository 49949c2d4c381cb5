"""Structured outputs and token constraints offline (LLM.generate / LLM.chat on the default
model): every output validates against its schema, regex, choices or grammar (greedy, n=3
sampled, under preemption); greedy constrained decoding equals transformers' generate() with
xgrammar's own logits processor; logit_bias, allowed_token_ids and bad_words do what they say;
bad specs are ValueErrors naming the field."""
from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
import torch

from pagedlm import LLM, EngineArgs, SamplingParams
from pagedlm.sampling_params import StructuredOutputsParams
from pagedlm.structured_output.sandbox import GrammarSandbox
from tests.compare_utils import assert_greedy_outputs_match
from tests.structured_cases import (CHOICE_PROMPT, CHOICES, GRAMMAR, GRAMMAR_PROMPT, GRAMMAR_RE,
                                    REGEX, REGEX_PROMPT, SCHEMAS)

MAX_TOKENS = 120  # enough for every schema's JSON to close


def chat(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def json_params(schema, **kw) -> SamplingParams:
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", MAX_TOKENS)
    return SamplingParams(structured_outputs=StructuredOutputsParams(json=schema), **kw)


@pytest.fixture(scope="module")
def llm():
    return LLM(kv_cache_memory_bytes=64 * 2**20)


def assert_all_blocks_free(llm):
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)
    sched = llm.llm_engine.scheduler
    assert not (sched.waiting or sched.running or sched.swapped)
    assert not llm.llm_engine._structured_ids


def assert_valid_json(outputs, schemas):
    for out, schema in zip(outputs, schemas):
        for c in out.outputs:
            assert c.finish_reason == "stop", c.text  # the grammar closed it
            jsonschema.validate(json.loads(c.text), schema)


# The server test runs all ten schemas (n=3, streamed and not); offline, four of them cover
# the engine's own paths (greedy, n=3 forks, preemption) at a third of the suite time.
OFFLINE = SCHEMAS[:4]


def test_schemas_greedy_and_n3(llm):
    schemas = [s for _, s in OFFLINE]
    greedy = llm.chat([chat(p) for p, _ in OFFLINE], [json_params(s) for s in schemas],
                      use_tqdm=False)
    assert_valid_json(greedy, schemas)
    # Sampled, three sequences each: every one has its own matcher.
    sampled = llm.chat([chat(p) for p, _ in OFFLINE],
                       [json_params(s, n=3, temperature=1.0, seed=i)
                        for i, s in enumerate(schemas)], use_tqdm=False)
    assert all(len(o.outputs) == 3 for o in sampled)
    assert_valid_json(sampled, schemas)
    assert len({c.text for o in sampled for c in o.outputs}) > len(OFFLINE)  # they differ
    assert_all_blocks_free(llm)


def test_greedy_equals_transformers_with_xgrammar(llm, hf_default_model, default_model_dir):
    """The reference: transformers' generate() masked by xgrammar's own HF logits processor."""
    import xgrammar as xgr
    from xgrammar.contrib.hf import LogitsProcessor
    from transformers import AutoTokenizer
    prompt, schema = SCHEMAS[1]
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    ours = llm.chat([chat(prompt)], json_params(schema), use_tqdm=False)[0]
    eos = sorted(llm.llm_engine.eos_token_ids)
    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=hf_default_model.config.vocab_size, stop_token_ids=eos)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(schema)
    ids = torch.tensor([ours.prompt_token_ids])
    with torch.no_grad():
        ref = hf_default_model.generate(ids, attention_mask=torch.ones_like(ids),
                                        max_new_tokens=MAX_TOKENS, do_sample=False,
                                        logits_processor=[LogitsProcessor(compiled)],
                                        eos_token_id=eos, pad_token_id=eos[0])
    assert ours.outputs[0].token_ids == ref[0, ids.shape[1]:].tolist()


def test_regex_choice_grammar_json_object(llm):
    tok = llm.get_tokenizer()
    so = StructuredOutputsParams
    cases = [(REGEX_PROMPT, so(regex=REGEX), lambda t: re.fullmatch(REGEX, t)),
             (CHOICE_PROMPT, so(choice=CHOICES), lambda t: t in CHOICES),
             (GRAMMAR_PROMPT, so(grammar=GRAMMAR), lambda t: GRAMMAR_RE.fullmatch(t)),
             ("Describe a cat as JSON.", so(json_object=True),
              lambda t: isinstance(json.loads(t), dict))]
    for n, temp in ((1, 0.0), (3, 1.0)):
        outs = llm.generate([p for p, _, _ in cases],
                            [SamplingParams(n=n, temperature=temp, seed=3, max_tokens=60,
                                            structured_outputs=s) for _, s, _ in cases],
                            use_tqdm=False)
        for (_, spec, ok), out in zip(cases, outs):
            for c in out.outputs:
                assert c.finish_reason == "stop" and ok(c.text), (spec.kind, c.text)
                # What was generated is what the text says (no hidden special tokens).
                assert tok.decode(c.token_ids, skip_special_tokens=True) == c.text
    assert_all_blocks_free(llm)


def test_a_compiling_grammar_holds_up_only_its_own_request(llm, monkeypatch):
    """Compilation runs on its own thread: while it is held back (as a slow schema would be),
    its request waits and the others run; then it runs too."""
    engine = llm.llm_engine
    manager = engine.structured_output
    gate = threading.Event()
    compile_for_real = manager._compile
    monkeypatch.setattr(manager, "_compile", lambda p: gate.wait(60) and compile_for_real(p))
    schema = {"type": "object", "properties": {"held": {"type": "boolean"}},
              "required": ["held"], "additionalProperties": False}
    engine.add_request("held", "Is it held? JSON:", json_params(schema))
    engine.add_request("plain", "Hello", SamplingParams(temperature=0, max_tokens=3))
    finished = {}
    for _ in range(4):
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert set(finished) == {"plain"}
    assert [g.request_id for g in engine.scheduler.waiting] == ["held"]
    gate.set()
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    jsonschema.validate(json.loads(finished["held"].outputs[0].text), schema)
    assert_all_blocks_free(llm)


def test_a_spec_nobody_waits_for_is_not_compiled(llm, monkeypatch):
    """Specs are checked one at a time, each up to the compile time limit: one whose clients
    all left while it queued is dropped unchecked; a later request compiles it afresh."""
    manager = llm.llm_engine.structured_output
    gate, checked = threading.Event(), []
    real = GrammarSandbox.check

    def check(self, params):
        checked.append(params.regex)
        if params.regex == "held-[a-z]{3}":
            gate.wait(60)
        return real(self, params)

    monkeypatch.setattr(GrammarSandbox, "check", check)
    held = manager.prepare(StructuredOutputsParams(regex="held-[a-z]{3}"))
    left = manager.prepare(StructuredOutputsParams(regex="left-[a-z]{3}"))
    manager.release(left)  # its client went away while it queued behind `held`
    gate.set()
    assert held.grammar.result(60) is not None
    manager.release(held)
    with pytest.raises(RuntimeError, match="no request waited"):
        left.grammar.result(60)
    assert checked == ["held-[a-z]{3}"]
    again = manager.prepare(StructuredOutputsParams(regex="left-[a-z]{3}"))
    try:
        assert again is not left and again.grammar.result(60) is not None
    finally:
        manager.release(again)
    assert checked == ["held-[a-z]{3}", "left-[a-z]{3}"]


def test_grammar_ends_the_sequence_even_with_ignore_eos(llm):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(choice=CHOICES))
    out = llm.generate([CHOICE_PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.text in CHOICES


@pytest.mark.parametrize("temperature", [0, 1], ids=["greedy", "sampled"])
def test_no_token_allowed_ends_the_sequence_without_breaking_its_grammar(llm, temperature):
    """Where a grammar allows no token (a regex that matches nothing), or allowed_token_ids
    leaves none of those it allows, the row had nothing to draw from: a sampled row drew a
    token the grammar refuses ("ectable"), which was returned as the output. It ends there,
    the token dropped."""
    token = llm.get_tokenizer().encode(" zebra")[0]
    cases = [StructuredOutputsParams(regex=r"[^\s\S]"),
             StructuredOutputsParams(choice=["yes", "no"])]
    params = [SamplingParams(temperature=temperature, seed=1, max_tokens=5,
                             structured_outputs=so,
                             allowed_token_ids=[token] if so.choice else None)
              for so in cases]
    outs = llm.generate(["Answer:"] * len(params), params, use_tqdm=False)
    for out in outs:
        c = out.outputs[0]
        assert c.finish_reason == "stop" and c.text == "" and list(c.token_ids) == [], c
    assert_all_blocks_free(llm)


def test_max_tokens_and_stop_strings_cut_structured_output(llm):
    prompt, schema = SCHEMAS[0]
    key = next(iter(schema["properties"]))
    full, cut, stopped = (o.outputs[0] for o in llm.chat(
        [chat(prompt)] * 3, [json_params(schema), json_params(schema, max_tokens=4),
                             json_params(schema, stop=[f'"{key}"'])], use_tqdm=False))
    assert cut.finish_reason == "length" and cut.token_ids == full.token_ids[:4]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == f'"{key}"'
    assert full.text.startswith(stopped.text) and f'"{key}"' in full.text[len(stopped.text):]


PREEMPT_SCHEMAS = [s for _, s in OFFLINE]
# Greedy, compared with the roomy cache's run. That one reads its prompts from the prefix cache
# the earlier tests filled, the small cache computes them afresh: their logits differ in the
# last bits, so the tokens match up to a near-tie (tests/compare_utils.py). Logprobs are the
# raw distribution's, where a grammar's two best tokens may rank low: hence the top 20.
PREEMPT_GREEDY = [json_params(s, logprobs=20) for s in PREEMPT_SCHEMAS]
# Sampled, two sequences each (forks preempted and resumed): last-bit differences can move a
# draw, so these are checked only to be valid, never against the other run.
PREEMPT_SAMPLED = [json_params(s, n=2, temperature=1.0, seed=i)
                   for i, s in enumerate(PREEMPT_SCHEMAS[:2])]


@pytest.fixture(scope="module")
def roomy_reference(llm):
    return llm.chat([chat(p) for p, _ in OFFLINE], PREEMPT_GREEDY, use_tqdm=False)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_structured_outputs_valid(roomy_reference, mode):
    """A cache too small for the batch: sequences are preempted mid-JSON and resumed; greedy
    outputs equal the roomy cache's (up to a near-tie), every output validates, and every block
    comes back."""
    small = LLM(num_gpu_blocks_override=14, preemption_mode=mode, swap_space=0.25)
    prompts = [chat(p) for p, _ in OFFLINE]
    outs = small.chat(prompts + prompts[:len(PREEMPT_SAMPLED)], PREEMPT_GREEDY + PREEMPT_SAMPLED,
                      use_tqdm=False)
    assert small.llm_engine.stats.num_preemptions > 0
    greedy, sampled = outs[:len(PREEMPT_GREEDY)], outs[len(PREEMPT_GREEDY):]
    identical = assert_greedy_outputs_match([o.outputs[0] for o in roomy_reference],
                                            [o.outputs[0] for o in greedy])
    assert identical >= len(greedy) // 2
    assert all(len(o.outputs) == 2 for o in sampled)
    assert_valid_json(outs, PREEMPT_SCHEMAS + PREEMPT_SCHEMAS[:len(PREEMPT_SAMPLED)])
    assert_all_blocks_free(small)
    small.shutdown()


def test_logit_bias_forces_and_bans(llm):
    prompt = "The capital of France is"
    forced_id = 1234

    def greedy(**kw):
        return SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, **kw)

    # One batch: the biased row does not touch its neighbour (string ids as OpenAI sends).
    forced, base = (o.outputs[0].token_ids for o in llm.generate(
        [prompt, prompt], [greedy(logit_bias={str(forced_id): 100}), greedy()],
        use_tqdm=False))
    assert forced == [forced_id] * 6 and base[0] != forced_id
    banned = llm.generate([prompt], greedy(logit_bias={base[0]: -100}),
                          use_tqdm=False)[0].outputs[0].token_ids
    assert base[0] not in banned


def test_allowed_token_ids_and_bad_words(llm):
    tok = llm.get_tokenizer()
    prompt = "Count from one to ten: one, two,"
    allowed = tok.encode(" three four five six,", add_special_tokens=False)
    out, base, banned = (o.outputs[0] for o in llm.generate([prompt] * 3, [
        SamplingParams(temperature=1.0, seed=0, max_tokens=12, ignore_eos=True,
                       allowed_token_ids=allowed),
        SamplingParams(temperature=0, max_tokens=12),
        SamplingParams(temperature=0, max_tokens=12, bad_words=["three"])], use_tqdm=False))
    assert out.token_ids and set(out.token_ids) <= set(allowed)
    assert " three" in base.text
    for text in ("three", " three"):
        ids = tok.encode(text, add_special_tokens=False)
        assert not any(banned.token_ids[i:i + len(ids)] == ids
                       for i in range(len(banned.token_ids)))
    assert banned.token_ids != base.token_ids


@pytest.mark.parametrize("kwargs, field", [
    (dict(allowed_token_ids=[5], stop_token_ids=[5], min_tokens=3), "min_tokens"),
    (dict(allowed_token_ids=["eos"], min_tokens=3), "min_tokens"),
    (dict(allowed_token_ids=[5], bad_words=["<file_sep>"]), "allowed_token_ids"),
])
def test_settings_that_leave_nothing_to_sample_are_refused(llm, kwargs, field):
    """Each left the first step's row all masked: the sampler drew a token outside the allow
    list ("ectable") and returned it, with finish_reason "length"."""
    eos = llm.get_tokenizer().eos_token_id
    kwargs = {**kwargs, "allowed_token_ids": [eos if t == "eos" else t
                                              for t in kwargs["allowed_token_ids"]]}
    with pytest.raises(ValueError, match=rf"^{field}:"):
        llm.generate(["Hi"], SamplingParams(max_tokens=4, **kwargs), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    # One allowed token more, and the request runs inside its list.
    kwargs["allowed_token_ids"] = kwargs["allowed_token_ids"] + [65]
    out = llm.generate(["Hi"], SamplingParams(max_tokens=4, **kwargs), use_tqdm=False)[0]
    assert set(out.outputs[0].token_ids) <= set(kwargs["allowed_token_ids"])


@pytest.mark.parametrize("temperature", [0, 1], ids=["greedy", "sampled"])
def test_an_allow_list_that_bad_words_exhaust_ends_the_sequence(llm, temperature):
    """"QQ" is [Q, Q]: after one Q the only allowed token is banned, nothing is left to draw.
    The drawn token is outside the list: the sequence ends before it."""
    q = llm.get_tokenizer().encode("Q", add_special_tokens=False)
    assert llm.get_tokenizer().encode("QQ", add_special_tokens=False) == q * 2
    out = llm.generate(["Letters:"], SamplingParams(
        temperature=temperature, seed=0, max_tokens=6, allowed_token_ids=q, bad_words=["QQ"]),
        use_tqdm=False)[0].outputs[0]
    assert list(out.token_ids) == q and out.finish_reason == "stop", out
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("kwargs, field", [
    (dict(json={"type": "object", "properties": 5}), "structured_outputs.json"),
    (dict(json="{not json"), "structured_outputs.json"),
    (dict(json=[1, 2]), "structured_outputs.json"),
    (dict(regex="([0-9]"), "structured_outputs.regex"),
    (dict(grammar="root ::= missing_rule"), "structured_outputs.grammar"),
    (dict(choice=[]), "structured_outputs.choice"),
    (dict(regex="a", choice=["a"]), "structured_outputs"),
    (dict(), "structured_outputs"),
    (dict(regex="a+", whitespace_pattern=" *"), "structured_outputs.whitespace_pattern"),
])
def test_bad_specs_name_the_field(llm, kwargs, field):
    with pytest.raises(ValueError, match=rf"^{re.escape(field)}\b"):
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(**kwargs)),
                     use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("kwargs, field", [
    (dict(logit_bias={5: 101}), "logit_bias"),
    (dict(logit_bias={"x": 1}), "logit_bias"),
    (dict(logit_bias={10**6: 1}), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[10**6]), "allowed_token_ids"),
    (dict(bad_words=[""]), "bad_words"),
    (dict(use_beam_search=True, n=2, temperature=0,
          structured_outputs=StructuredOutputsParams(regex="a")), "structured_outputs"),
])
def test_bad_token_constraints_name_the_field(llm, kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        llm.generate(["x"], SamplingParams(**kwargs), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_bitmask_kernel_and_torch_fallback_agree_with_the_definition(monkeypatch):
    from pagedlm.structured_output import bitmask as bm
    torch.manual_seed(0)
    vocab, rows = 100, [1, 3]
    words = torch.randint(-2**31, 2**31 - 1, (4, bm.bitmask_width(vocab)), dtype=torch.int32)
    for width in (vocab, 128):  # the logits as wide as the vocabulary, and padded
        logits = torch.randn(4, width)
        expected = logits.clone()
        for r in rows:
            for t in range(width):
                if t >= vocab or not (int(words[r, t // 32]) >> (t % 32)) & 1:
                    expected[r, t] = float("-inf")
        mask = bm.GrammarBitmask(rows, words, vocab)
        assert torch.equal(bm.apply_grammar_bitmask(logits.clone(), mask), expected)
        monkeypatch.setattr(bm, "_kernel", lambda: None)  # as without xgrammar
        assert torch.equal(bm.apply_grammar_bitmask(logits.clone(), mask), expected)
        monkeypatch.undo()


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match=r"structured_outputs_backend .*'xgrammar'"):
        EngineArgs(structured_outputs_backend="outlines").create_engine_config()


def test_backend_is_imported_at_the_first_structured_request_not_at_start_up(monkeypatch):
    """xgrammar takes about a second to import: an engine is built without it."""
    import sys

    from pagedlm.structured_output.manager import StructuredOutputManager
    # None in sys.modules: any import of the backend module raises ImportError.
    monkeypatch.setitem(sys.modules, "pagedlm.structured_output.xgrammar_backend", None)
    manager = StructuredOutputManager("xgrammar", None, 10, frozenset())
    with pytest.raises(ImportError):
        manager.backend_cls
    with pytest.raises(ValueError, match=r"structured_outputs_backend .*'xgrammar'"):
        StructuredOutputManager("outlines", None, 10, frozenset())


def test_a_ctrl_c_while_a_spec_is_queued_leaves_it_compilable(llm):
    """A real Ctrl-C (SIGINT) between a new spec's entry in the compilation cache and its
    submission to the compile threads: the interrupt waits for the submission. Raised there,
    it left a compilation nothing would ever finish, and every later request with that spec
    waited on it for good."""
    from concurrent.futures import Future

    from tests.engine.test_engine_failure import _sigint_at
    spec = StructuredOutputsParams(regex="[a-z]{4}-[0-9]{3}-ctrl-c")
    params = SamplingParams(temperature=0, max_tokens=24, structured_outputs=spec)
    seen: list = []
    with _sigint_at(Future.add_done_callback.__code__, "call", 1, seen), \
            pytest.raises(KeyboardInterrupt):
        llm.generate("Code:", params, use_tqdm=False)
    assert seen
    done: list = []
    thread = threading.Thread(target=lambda: done.append(
        llm.generate("Code:", params, use_tqdm=False)), daemon=True)
    thread.start()
    thread.join(60)  # (compiled in well under a second)
    assert done, "the spec's compilation never finished"
    assert re.fullmatch("[a-z]{4}-[0-9]{3}-ctrl-c", done[0][0].outputs[0].text)
