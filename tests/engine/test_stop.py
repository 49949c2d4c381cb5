"""Stopping (stop strings, stop token ids, EOS, max_tokens), incremental detokenization and
streaming output kinds, and aborting requests, through the real engine on the default model."""
from collections import defaultdict

import pytest

from pagedlm import SamplingParams
from pagedlm.engine.detokenizer import IncrementalDetokenizer
from pagedlm.engine.stop_checker import check_stop
from pagedlm.sampling_params import RequestOutputKind
from pagedlm.sequence import SequenceStatus


@pytest.fixture(scope="module")
def llm():
    from pagedlm import LLM
    return LLM(kv_cache_memory_bytes=512 * 2**20)


@pytest.fixture(scope="module")
def tok(llm):
    return llm.get_tokenizer()


def assert_engine_clean(llm):
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.requests == {}
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


STORY = "Once upon a time"
MAX = 16


def find_split_stop(tok, ids, text):
    """A 4-char stop string made of the last 2 chars of token i and the first 2 of token i+1,
    occurring first exactly there. Returns (stop, start offset in text, i)."""
    ends = [len(tok.decode(ids[:i + 1], skip_special_tokens=True)) for i in range(len(ids))]
    for i in range(2, len(ids) - 2):
        start, mid, end = ends[i - 1], ends[i], ends[i + 1]
        if mid - start < 2 or end - mid < 2:
            continue
        stop = text[mid - 2:mid + 2]
        if stop.isascii() and text.find(stop) == mid - 2:
            return stop, mid - 2, i
    raise AssertionError(f"no token-straddling stop string in {text!r}")


@pytest.fixture(scope="module")
def story(llm, tok):
    """The greedy continuation of STORY, with a stop string straddling a token boundary."""
    out = llm.generate(STORY, SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == MAX
    assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
    stop, at, i = find_split_stop(tok, out.token_ids, out.text)
    return out, stop, at, i


def test_stop_strings_and_stop_token_ids(llm, tok, story):
    ref, stop, at, i = story
    ids, text = ref.token_ids, ref.text
    # A stop token id: the first token (past the first few) that has not occurred before.
    j = next(k for k in range(3, MAX) if ids[k] not in ids[:k])
    stop_id = ids[j]
    base = dict(temperature=0, max_tokens=MAX, ignore_eos=True)
    params = [
        SamplingParams(stop=[stop], **base),
        SamplingParams(stop=stop, include_stop_str_in_output=True, **base),
        SamplingParams(stop=["never appears \u2603", stop], **base),
        SamplingParams(stop=["never appears \u2603"], **base),
        SamplingParams(stop_token_ids=[stop_id], **base),
        SamplingParams(stop_token_ids=[stop_id], include_stop_str_in_output=True, **base),
    ]
    outs = [o.outputs[0] for o in llm.generate([STORY] * len(params), params, use_tqdm=False)]

    excl, incl, multi, never, by_id, by_id_incl = outs
    for o in (excl, incl, multi):
        assert o.finish_reason == "stop", o
        assert o.stop_reason == stop
        # Generation ends on the token that completes the stop string.
        assert o.token_ids == ids[:i + 2]
    assert excl.text == text[:at]
    assert multi.text == text[:at]
    assert incl.text == text[:at + len(stop)]
    assert stop not in excl.text and incl.text.endswith(stop)

    assert never.finish_reason == "length" and never.stop_reason is None
    assert never.text == text and never.token_ids == ids

    for o in (by_id, by_id_incl):
        assert o.finish_reason == "stop"
        assert o.stop_reason == stop_id
        assert o.token_ids == ids[:j + 1]
    # As in vLLM, the stop token's own text is left out unless include_stop_str_in_output.
    assert by_id.text == tok.decode(ids[:j], skip_special_tokens=True)
    assert by_id_incl.text == tok.decode(ids[:j + 1], skip_special_tokens=True)
    assert_engine_clean(llm)


@pytest.mark.parametrize("stops, include, end, reason", [
    (["o", "e"], False, 1, "e"),  # the list named "o" first: the text kept an "e"
    (["o", "e"], True, 2, "e"),
    (["ll", "l"], False, 2, "l"),  # the same start: the shorter one ends first
    (["ll", "l"], True, 3, "l"),
])
def test_the_text_ends_at_the_first_stop_string_a_token_brings(stops, include, end, reason):
    """One token's text can complete two stop strings; the output ends at the earlier one,
    whatever the list's order (OpenAI: the text stops at the first stop sequence)."""
    params = SamplingParams(stop=stops, include_stop_str_in_output=include)
    text = "hello"  # all of it brought by the new token
    d = check_stop(params, frozenset(), 100, seq_len=6, num_output_tokens=1, token_id=7,
                   text=text, new_chars=len(text))
    assert d is not None and d.status is SequenceStatus.FINISHED_STOPPED
    assert (text[:d.text_end], d.stop_reason) == (text[:end], reason)


def test_max_tokens_eos_and_ignore_eos(llm, tok):
    eos = tok.eos_token_id
    conv = [{"role": "user", "content": "What is 2+2? Answer with a number only."}]
    params = [SamplingParams(temperature=0, max_tokens=20),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=5),
              SamplingParams(temperature=0, max_tokens=20, skip_special_tokens=False)]
    outs = [o.outputs[0] for o in llm.chat([conv] * 4, params, use_tqdm=False)]
    short, ignored, capped, special = outs

    assert short.finish_reason == "stop" and short.stop_reason is None
    assert short.token_ids[-1] == eos and eos not in short.token_ids[:-1]
    assert len(short.token_ids) < 12
    assert short.text == tok.decode(short.token_ids, skip_special_tokens=True)
    assert tok.eos_token not in short.text and short.text.strip()

    assert ignored.finish_reason == "length" and len(ignored.token_ids) == 12
    assert ignored.token_ids[:len(short.token_ids)] == short.token_ids

    assert capped.finish_reason == "length" and len(capped.token_ids) == 5
    assert capped.token_ids == short.token_ids[:5]

    # The EOS that ends the request is not part of the text, even with special tokens kept.
    assert special.token_ids == short.token_ids
    assert special.text == short.text
    assert_engine_clean(llm)


DETOK_TEXTS = [
    "Écris une phrase en français avec des accents: à l'été, où ça? Déjà!",
    "Emoji: 🚀🌊👍🏽 and 👨‍👩‍👧 family, flags 🇫🇷.",
    "日本語のテキスト、中文字符，한국어 텍스트。",
    "  multiple   spaces\n\n\ttabs and\r\nnewlines  ",
    "def f(x):\n    return x ** 2  # ∑x² ≤ π",
]


@pytest.mark.parametrize("text", DETOK_TEXTS, ids=range(len(DETOK_TEXTS)))
def test_incremental_detokenizer_matches_decode(tok, text):
    detok = IncrementalDetokenizer(tok)
    prompt = tok.encode("Some prompt text to give left context: ")
    ids = tok.encode(text)
    # Put an EOS (special) in the middle: skipped like decode(skip_special_tokens=True) does.
    ids = ids[:len(ids) // 2] + [tok.eos_token_id] + ids[len(ids) // 2:]
    state = detok.init_state(prompt, True)
    pieces = [detok.step(state, t, True) for t in ids]
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)
    assert "\ufffd" not in "".join(pieces)


def matches_decode(tok, text, ids):
    expected = tok.decode(ids, skip_special_tokens=True)
    # A trailing incomplete UTF-8 sequence (cut by max_tokens) is held back, as in vLLM.
    return text == expected or (expected.endswith("\ufffd") and text == expected.rstrip("\ufffd"))


def test_generated_text_matches_decode(llm, tok):
    prompts = ["Écris une phrase en français avec des accents:",
               "Write a sentence with three emoji about the sea: 🌊",
               "Translate to Japanese: good morning, friends.",
               STORY]
    params = [SamplingParams(temperature=0.9, seed=s, max_tokens=16) for s in range(4)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    non_ascii = 0
    for o in outs:
        c = o.outputs[0]
        assert c.token_ids
        assert matches_decode(tok, c.text, c.token_ids), (c.text, c.token_ids)
        non_ascii += not c.text.isascii()
    assert non_ascii >= 1  # the multilingual prompts really produced non-ASCII text
    assert_engine_clean(llm)


def run_engine(engine, requests):
    """Add (request_id, prompt, params) and step to completion; outputs per request id."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    got = defaultdict(list)
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id].append(out)
        steps += 1
        assert steps < 200
    return got


def test_streaming_output_kinds(llm, tok, story):
    ref, stop, at, i = story
    engine = llm.llm_engine
    fr = "Écris une phrase en français avec des accents:"
    D, C, F = RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY

    def sp(kind, **kw):
        return SamplingParams(output_kind=kind, **kw)

    sampled = dict(temperature=0.9, seed=7, max_tokens=12, logprobs=2)
    stopped = dict(temperature=0, max_tokens=MAX, stop=[stop], ignore_eos=True)
    got = run_engine(engine, [
        ("d-fr", fr, sp(D, **sampled)), ("c-fr", fr, sp(C, **sampled)),
        ("f-fr", fr, sp(F, **sampled)),
        ("d-stop", STORY, sp(D, **stopped)), ("c-stop", STORY, sp(C, **stopped)),
        ("d-nomatch", STORY, sp(D, temperature=0, max_tokens=MAX, ignore_eos=True,
                                stop=["no match \u2603"])),
    ])
    assert set(got) == {"d-fr", "c-fr", "f-fr", "d-stop", "c-stop", "d-nomatch"}

    # FINAL_ONLY: one output, at the end.
    assert len(got["f-fr"]) == 1 and got["f-fr"][0].finished

    for name in ("fr", "stop"):
        deltas, cums = got[f"d-{name}"], got[f"c-{name}"]
        final = cums[-1].outputs[0]
        # Only the last output is finished.
        assert [o.finished for o in deltas] == [False] * (len(deltas) - 1) + [True]
        assert [o.finished for o in cums] == [False] * (len(cums) - 1) + [True]
        # DELTA: the pieces add up to the final cumulative text and tokens.
        assert "".join(o.outputs[0].text for o in deltas) == final.text
        assert sum((o.outputs[0].token_ids for o in deltas), []) == final.token_ids
        assert deltas[-1].outputs[0].finish_reason == final.finish_reason
        # CUMULATIVE: every intermediate text is a prefix of the final text.
        for o in cums:
            assert final.text.startswith(o.outputs[0].text), (o.outputs[0].text, final.text)
            assert final.token_ids[:len(o.outputs[0].token_ids)] == o.outputs[0].token_ids

    fr_final = got["c-fr"][-1].outputs[0]
    assert got["f-fr"][0].outputs[0].text == fr_final.text
    assert matches_decode(tok, fr_final.text, fr_final.token_ids)
    d_lp = sum((o.outputs[0].logprobs for o in got["d-fr"]), [])
    assert [sorted(lp) for lp in d_lp] == [sorted(lp) for lp in fr_final.logprobs]

    # Text held back for a stop string that never matches is all released at the end.
    nomatch = got["d-nomatch"]
    assert "".join(o.outputs[0].text for o in nomatch) == ref.text
    assert nomatch[-1].outputs[0].finish_reason == "length"

    stop_final = got["c-stop"][-1].outputs[0]
    assert stop_final.text == ref.text[:at] and stop_final.stop_reason == stop
    assert_engine_clean(llm)


def test_abort(llm, story):
    ref = story[0]
    engine = llm.llm_engine
    p = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    for k in range(3):
        engine.add_request(f"ab-{k}", STORY if k == 0 else f"Request number {k}:", p)
    seen = defaultdict(list)
    for _ in range(3):
        for out in engine.step():
            seen[out.request_id].append(out)
    assert all(len(seen[f"ab-{k}"]) == 3 for k in range(3))
    assert not seen["ab-1"][-1].finished
    free_before = engine.block_manager.num_free_blocks
    engine.abort_request("ab-1")
    assert engine.block_manager.num_free_blocks > free_before  # its blocks came back
    engine.add_request("ab-3", "Never scheduled", p)
    engine.abort_request(["ab-3", "no-such-request"])
    assert engine.get_num_unfinished_requests() == 2
    assert set(engine.requests) == {"ab-0", "ab-2"}

    after = defaultdict(list)
    while engine.has_unfinished_requests():
        for out in engine.step():
            after[out.request_id].append(out)
    assert set(after) == {"ab-0", "ab-2"}
    for k in (0, 2):
        last = after[f"ab-{k}"][-1]
        assert last.finished and last.outputs[0].finish_reason == "length"
        assert len(last.outputs[0].token_ids) == 10
    # The survivors were not disturbed: ab-0 is the plain greedy continuation.
    assert after["ab-0"][-1].outputs[0].token_ids == ref.token_ids[:10]
    engine.abort_request("ab-0")  # already finished: no effect
    assert_engine_clean(llm)
