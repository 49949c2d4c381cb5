"""Tool calling on the chat endpoint: real server over a socket, `openai` client, the default
SmolLM2-135M-Instruct with the repository's Hermes-style ChatML template.

The model is tiny, so the "auto" tests show it two earlier calls (a few-shot conversation);
what it then writes is whatever it writes: the tests compare the server's tool_calls with the
raw text the same prompt gives on /v1/completions, parsed here independently. "required" and
named choices are grammar-constrained, so their arguments must validate with jsonschema.
Parser tests run real-format strings whole and in chunks of several sizes.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import jsonschema
import openai
import pydantic
import pytest

from pagedlm import EngineArgs
from pagedlm.engine.async_llm_engine import AsyncLLMEngine
from pagedlm.entrypoints.openai.api_server import build_app
from pagedlm.entrypoints.openai.tool_parsers import TOOL_PARSERS, get_tool_parser
from pagedlm.entrypoints.openai.tool_parsers.constrained import (NamedFunctionParser,
                                                                 RequiredToolsParser,
                                                                 required_tools_schema)
from pagedlm.entrypoints.openai.tool_parsers.streaming import ToolCallStreamer
from tests.server_utils import assert_all_blocks_free, serve_in_thread, wait_until_idle

MODEL = "smollm2-tools"
TEMPLATE = (Path(__file__).resolve().parents[2] / "examples"
            / "tool_chat_template_hermes_chatml.jinja").read_text()

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "minLength": 1, "maxLength": 20},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Get the current time in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "minLength": 1, "maxLength": 20},
            "hours_ahead": {"type": "integer", "minimum": 0, "maximum": 12}},
            "required": ["city", "hours_ahead"], "additionalProperties": False}}},
]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _call(i: int, name: str, args: dict) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"call_{i}", "type": "function",
         "function": {"name": name, "arguments": json.dumps(args)}}]}


# Two earlier turns in which the assistant called a tool, then a new question.
FEW_SHOT = [
    {"role": "user", "content": "What is the weather in Paris?"},
    _call(1, "get_weather", {"city": "Paris", "unit": "celsius"}),
    {"role": "user", "content": "What time is it in Tokyo?"},
    _call(2, "get_time", {"city": "Tokyo", "hours_ahead": 0}),
    {"role": "user", "content": "What is the weather in Berlin?"},
]


@pytest.fixture(scope="module")
def engine():
    engine = AsyncLLMEngine.from_engine_args(
        EngineArgs(max_model_len=1024, num_gpu_blocks_override=256), log_stats=False,
        model_name=MODEL)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    with serve_in_thread(engine, served_model_names=[MODEL], chat_template=TEMPLATE,
                         enable_auto_tool_choice=True, tool_call_parser="hermes") as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def tokenizer(engine):
    return engine.get_tokenizer()


def _template_messages(messages: list[dict]) -> list[dict]:
    """As the server gives messages to templates: call arguments as mappings."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(
                c["function"]["arguments"])}} for c in m["tool_calls"]]
        out.append(m)
    return out


def _render(tokenizer, messages, tools=TOOLS) -> str:
    return tokenizer.apply_chat_template(_template_messages(messages), tools=tools,
                                         chat_template=TEMPLATE, tokenize=False,
                                         add_generation_prompt=True)


def _reassemble(chunks) -> tuple[list[dict], str, str | None]:
    """Streamed tool-call deltas put back together, checking OpenAI's shape on the way: a
    call's first delta has its id, type and name (once); later ones only argument text."""
    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            if d.index not in calls:
                assert d.index == len(calls) and d.id and d.type == "function"
                assert d.function.name
                calls[d.index] = {"id": d.id, "name": d.function.name,
                                  "arguments": d.function.arguments or ""}
            else:
                assert d.id is None and d.function.name is None
                calls[d.index]["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return [calls[i] for i in sorted(calls)], content, finish


def _as_list(message) -> list[dict]:
    return [{"name": c.function.name, "arguments": c.function.arguments}
            for c in message.tool_calls or []]


def _stream(client, **kwargs):
    return _reassemble(client.chat.completions.create(model=MODEL, stream=True, **kwargs))


# ---- auto, with the hermes parser ----

def test_auto_hermes_tool_calls_match_the_raw_output(client, tokenizer):
    # The three calls are compared on one compute path: a prefix-cache hit on another call's
    # blocks changes the logits' last bits, which can flip a near-tie. Own salts: no hits.
    r = client.chat.completions.create(model=MODEL, messages=FEW_SHOT, tools=TOOLS,
                                       tool_choice="auto", temperature=0, max_tokens=40,
                                       extra_body={"cache_salt": "auto-chat"})
    (choice,) = r.choices
    # The tools went through the template: the prompt is the locally rendered one.
    prompt = _render(tokenizer, FEW_SHOT)
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
    raw = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=40,
                                    extra_body={"add_special_tokens": False,
                                                "cache_salt": "auto-raw"}).choices[0].text
    expected = [json.loads(body) for body in
                re.findall(r"<tool_call>\s*(.*?)\s*</tool_call>", raw, re.S)]
    assert expected, f"the model wrote no tool call: {raw!r}"
    assert choice.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in choice.message.tool_calls] == [(e["name"], e["arguments"])
                                                    for e in expected]
    assert all(c.id and c.type == "function" for c in choice.message.tool_calls)
    assert (choice.message.content or "") == raw[:raw.index("<tool_call>")]

    calls, content, finish = _stream(client, messages=FEW_SHOT, tools=TOOLS, tool_choice="auto",
                                     temperature=0, max_tokens=40,
                                     extra_body={"cache_salt": "auto-stream"})
    assert finish == "tool_calls" and content == (choice.message.content or "")
    assert [{"name": c["name"], "arguments": c["arguments"]} for c in calls] == \
        _as_list(choice.message)


def test_tool_message_round_trip(client, tokenizer):
    """An assistant turn's tool_calls and the tool's answer are sent back and rendered."""
    messages = FEW_SHOT[:2] + [
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 18}'},
        {"role": "user", "content": "And what time is it there?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                       temperature=0, max_tokens=8)
    prompt = _render(tokenizer, messages)
    assert '{"temperature": 18}' in prompt and '"arguments": {"city": "Paris"' in prompt
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_tool_choice_none_is_plain_chat(client, tokenizer):
    r = client.chat.completions.create(model=MODEL, messages=FEW_SHOT[-1:], tools=TOOLS,
                                       tool_choice="none", temperature=0, max_tokens=4)
    assert r.choices[0].message.tool_calls is None
    # No tools in the prompt: the model is not told of tools it may not call.
    assert r.usage.prompt_tokens == len(tokenizer.encode(
        _render(tokenizer, FEW_SHOT[-1:], tools=None), add_special_tokens=False))


# ---- grammar-constrained: required and named ----

def _validate(calls: list[dict]) -> None:
    assert calls
    for c in calls:
        assert c["name"] in PARAMETERS, c
        jsonschema.validate(json.loads(c["arguments"]), PARAMETERS[c["name"]])


def test_required_arguments_validate(client):
    question = [{"role": "user", "content": "What is the weather and the time in Rome?"}]
    r = client.chat.completions.create(model=MODEL, messages=question, tools=TOOLS,
                                       tool_choice="required", n=3, temperature=1.0, seed=7,
                                       max_tokens=80)
    finished = [c for c in r.choices if c.finish_reason == "tool_calls"]
    assert finished, r.choices
    for choice in finished:
        _validate(_as_list(choice.message))
    for choice in r.choices:
        if choice.finish_reason == "length":
            # A sampled array can go on past max_tokens (the tiny model repeats calls): it
            # comes back as content, and each of its whole calls still validates.
            assert choice.message.tool_calls is None
            partial = RequiredToolsParser().parse(choice.message.content, final=False)
            for call in partial.calls:
                if call.done:
                    jsonschema.validate(json.loads(call.arguments), PARAMETERS[call.name])
    # Streamed and not, compared on one compute path: a prefix-cache hit on the other call's
    # blocks changes the logits' last bits, which can flip a near-tie. Own salts: no hits.
    greedy = client.chat.completions.create(model=MODEL, messages=question, tools=TOOLS,
                                            tool_choice="required", temperature=0,
                                            max_tokens=120,
                                            extra_body={"cache_salt": "required-full"}
                                            ).choices[0]
    _validate(_as_list(greedy.message))
    calls, content, finish = _stream(client, messages=question, tools=TOOLS,
                                     tool_choice="required", temperature=0, max_tokens=120,
                                     extra_body={"cache_salt": "required-stream"})
    assert finish == "tool_calls" and content == ""
    assert [{"name": c["name"], "arguments": c["arguments"]} for c in calls] == \
        _as_list(greedy.message)


@pytest.mark.parametrize("name", ["get_weather", "get_time"])
def test_named_function_arguments_validate(client, name):
    question = [{"role": "user", "content": "Tell me about Madrid."}]
    choice = {"type": "function", "function": {"name": name}}
    r = client.chat.completions.create(model=MODEL, messages=question, tools=TOOLS,
                                       tool_choice=choice, temperature=0, max_tokens=60)
    (c,) = r.choices
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert [t.function.name for t in c.message.tool_calls] == [name]
    _validate(_as_list(c.message))
    calls, _, finish = _stream(client, messages=question, tools=TOOLS, tool_choice=choice,
                               temperature=0, max_tokens=60)
    assert finish == "tool_calls"
    assert [{"name": x["name"], "arguments": x["arguments"]} for x in calls] == \
        _as_list(c.message)


class _Address(pydantic.BaseModel):
    city: str = pydantic.Field(min_length=1, max_length=20)


class _Parcel(pydantic.BaseModel):
    address: _Address
    inner: _Parcel | None = None  # "#/$defs/_Parcel": recursion through a reference


# As openai.pydantic_function_tool writes nested models: "$defs" and references into them.
SHIP = openai.pydantic_function_tool(_Parcel, name="ship", description="Ship a parcel")


def test_required_rebases_each_tools_local_references():
    schema = required_tools_schema([(t["function"]["name"], t["function"]["parameters"])
                                    for t in TOOLS + [SHIP]])
    good = [{"name": "ship", "parameters": {"address": {"city": "Oslo"}, "inner": {
        "address": {"city": "Rome"}, "inner": None}}},
        {"name": "get_time", "parameters": {"city": "Oslo", "hours_ahead": 1}}]
    jsonschema.validate(good, schema)
    bad = [{"name": "ship", "parameters": {"address": {"city": "Oslo"}, "inner": {
        "address": {}, "inner": None}}}]  # the nested reference's "city" is required
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)
    # A property named like a data keyword is still a schema; data keywords are left alone.
    odd = {"type": "object", "properties": {"enum": {"$ref": "#/$defs/A"}},
           "$defs": {"A": {"const": {"$ref": "#/x"}}}}
    rebased = required_tools_schema([("f", odd)])["items"]["anyOf"][0]["properties"]
    assert rebased["parameters"]["properties"]["enum"]["$ref"] == \
        "#/items/anyOf/0/properties/parameters/$defs/A"
    assert rebased["parameters"]["$defs"]["A"]["const"] == {"$ref": "#/x"}


def test_required_with_a_pydantic_tool(server, client):
    question = [{"role": "user", "content": "Ship the parcel to Paris."}]
    r = client.chat.completions.create(model=MODEL, messages=question, tools=TOOLS + [SHIP],
                                       tool_choice="required", temperature=0, max_tokens=80)
    (c,) = r.choices
    parameters = {**PARAMETERS, "ship": SHIP["function"]["parameters"]}
    if c.finish_reason == "tool_calls":
        for call in _as_list(c.message):
            jsonschema.validate(json.loads(call["arguments"]), parameters[call["name"]])
    else:  # the tiny model can repeat calls past max_tokens; its whole calls still validate
        assert c.finish_reason == "length"
        for call in RequiredToolsParser().parse(c.message.content, final=False).calls:
            if call.done:
                jsonschema.validate(json.loads(call.arguments), parameters[call.name])
    wait_until_idle(server.engine)
    assert_all_blocks_free(server.engine)


# ---- bad input: a 400 naming the field, and the server keeps serving ----

def _bad(**overrides) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
            "max_tokens": 2}
    body.update(overrides)
    return {k: v for k, v in body.items() if v is not None}


def _tool(**function) -> list[dict]:
    return [{"type": "function", "function": function}]


BAD_REQUESTS = [
    (_bad(tool_choice={"type": "function", "function": {"name": "get_stock"}}), "tool_choice"),
    (_bad(tools=None, tool_choice="required"), "tool_choice"),
    (_bad(tools=None, tool_choice={"type": "function", "function": {"name": "get_time"}}),
     "tool_choice"),
    (_bad(tool_choice="sometimes"), "tool_choice"),
    (_bad(tools=_tool(description="no name", parameters={"type": "object"})),
     "tools.0.function.name"),
    (_bad(tools=_tool(name="get weather")), "tools.0.function.name"),
    (_bad(tools=_tool(name="f", parameters={"type": "string"})), "tools.0.function.parameters"),
    (_bad(tools=_tool(name="f", parameters=[1])), "tools.0.function.parameters"),
    (_bad(tools=_tool(name="f", parameters={"type": "object", "properties": [1]})),
     "tools.0.function.parameters.properties"),
    (_bad(tools=TOOLS + TOOLS[:1]), "tools.2.function.name"),
    # A schema the grammar compiler rejects, when the output is constrained by it.
    (_bad(tools=TOOLS + _tool(name="f", parameters={"type": "object", "properties": {
        "a": {"type": "strang"}}}), tool_choice={"type": "function", "function": {"name": "f"}}),
     "tools.2.function.parameters"),
    (_bad(tools=_tool(name="f", parameters={"type": "object", "properties": {
        "a": {"type": "strang"}}}), tool_choice="required"), "tools"),
    # required / named constrain the output themselves: no second constraint.
    (_bad(tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
    (_bad(tool_choice="required", use_beam_search=True, temperature=0, n=2), "tool_choice"),
    (_bad(tools=[{"type": "retrieval", "function": {"name": "f"}}]), "tools.0.type"),
    (_bad(messages=[{"role": "user", "content": "hi"},
                    {"role": "tool", "content": "18 degrees"}]), "messages.1.tool_call_id"),
    (_bad(messages=FEW_SHOT[:2] + [{"role": "tool", "tool_call_id": "call_9", "content": "x"}]),
     "messages.2.tool_call_id"),
    (_bad(messages=[FEW_SHOT[0], {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather",
                                                     "arguments": "{city: Paris"}}]}]),
     "messages.1.tool_calls.0.function.arguments"),
    (_bad(messages=[FEW_SHOT[0], {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather"}}]}]),
     "messages.1.tool_calls.0.function.arguments"),
]


@pytest.mark.parametrize("body, param", BAD_REQUESTS)
def test_bad_tool_requests_are_400(server, body, param):
    r = httpx.post(server.base_url + "/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == 400 and err["type"] == "BadRequestError"
    assert err["message"]


def test_server_keeps_serving_after_bad_tool_requests(server, client):
    for body, _ in BAD_REQUESTS[:4]:
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(**body)
    r = client.chat.completions.create(model=MODEL, messages=FEW_SHOT[-1:], max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length")
    wait_until_idle(server.engine)
    assert_all_blocks_free(server.engine)


def test_auto_needs_enable_auto_tool_choice(engine):
    # A second app on the same engine, started without --enable-auto-tool-choice.
    with serve_in_thread(engine, served_model_names=[MODEL], chat_template=TEMPLATE) as plain:
        c = openai.OpenAI(base_url=plain.base_url, api_key="none", max_retries=0)
        for tool_choice in ("auto", None):  # tools given, no tool_choice: "auto" (as vLLM)
            kwargs = {} if tool_choice is None else {"tool_choice": tool_choice}
            with pytest.raises(openai.BadRequestError) as exc_info:
                c.chat.completions.create(model=MODEL, messages=FEW_SHOT, tools=TOOLS,
                                          max_tokens=2, **kwargs)
            body = exc_info.value.body
            assert body["param"] == "tool_choice" and "--enable-auto-tool-choice" in \
                body["message"]


def test_unknown_tool_call_parser_is_a_clear_error(engine, capsys):
    with pytest.raises(ValueError, match="hermes, llama3_json, pythonic"):
        build_app(engine, enable_auto_tool_choice=True, tool_call_parser="mistral")
    from pagedlm.entrypoints.cli import make_parser
    with pytest.raises(SystemExit):
        make_parser().parse_args(["serve", "--tool-call-parser", "mistral"])
    assert "hermes, llama3_json, pythonic" in capsys.readouterr().err


# ---- parsers on real-format strings, whole and streamed in chunks ----

def _stream_parse(parser, text: str, step: int) -> tuple[str | None, list[tuple[str, str]]]:
    streamer = ToolCallStreamer(parser)
    content, calls = "", {}
    for i in range(0, len(text), step):
        delta = streamer.feed(text[i:i + step], final=i + step >= len(text))
        if delta is None:
            continue
        content += delta.content or ""
        for d in delta.tool_calls or []:
            if d.index in calls:
                assert d.function.name is None
                calls[d.index][1] += d.function.arguments
            else:
                calls[d.index] = [d.function.name, d.function.arguments]
    return content or None, [tuple(calls[i]) for i in sorted(calls)]


HERMES = ('Let me look that up.\n<tool_call>\n{"name": "get_weather", "arguments": '
          '{"city": "New York}", "days": [1, 2], "opts": {"q": "a \\"quoted\\" word"}}}\n'
          '</tool_call>\n<tool_call>\n{"arguments": {"tz": "UTC"}, "name": "get_time"}\n'
          '</tool_call>')
LLAMA3 = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "n": 2.5}}; '
          '{"name": "get_time", "parameters": {}}')
PYTHONIC = '[get_weather(city="Paris", days=[1, 2], metric=True), get_time(tz=\'UTC\')]'
REQUIRED = '[{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}]'


@pytest.mark.parametrize("parser, text, expected", [
    ("hermes", HERMES, ("Let me look that up.\n", [
        ("get_weather", {"city": "New York}", "days": [1, 2], "opts": {"q": 'a "quoted" word'}}),
        ("get_time", {"tz": "UTC"})])),
    ("llama3_json", LLAMA3, (None, [("get_weather", {"city": "Paris", "n": 2.5}),
                                    ("get_time", {})])),
    ("pythonic", PYTHONIC, (None, [("get_weather", {"city": "Paris", "days": [1, 2],
                                                    "metric": True}),
                                   ("get_time", {"tz": "UTC"})])),
    ("required", REQUIRED, (None, [("get_weather", {"city": "Oslo", "unit": "celsius"})])),
])
def test_parsers_whole_and_streamed(parser, text, expected):
    make = RequiredToolsParser if parser == "required" else get_tool_parser(parser)
    whole = make().extract_tool_calls(text)
    assert (whole.content, [(n, json.loads(a)) for n, a in whole.calls]) == expected
    for step in (1, 2, 5, 13, len(text)):
        assert _stream_parse(make(), text, step) == (whole.content, whole.calls), step


@pytest.mark.parametrize("parser, text", [
    ("hermes", "No tools needed: 2 < 3 and <tool is not a tag."),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'),  # cut short
    ("hermes", "<tool_call>\nnot json\n</tool_call>"),
    ("llama3_json", "The weather is fine."),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": '),
    ("pythonic", "Sure, here you go."),
    ("pythonic", "[get_weather('Paris')]"),  # positional arguments have no JSON names
    ("pythonic", "[get_weather(city=Paris)]"),  # not a literal
])
def test_parsers_return_unparsable_output_as_content(parser, text):
    whole = get_tool_parser(parser)().extract_tool_calls(text)
    assert whole.content == text and whole.calls == []
    content, _ = _stream_parse(get_tool_parser(parser)(), text, 3)
    assert text.startswith(content or "")  # streamed content never runs ahead of the text


@pytest.mark.parametrize("parser, text, call", [
    # A name that is half an escaped pair is no name: the text stays content.
    ("hermes", '<tool_call>\n{"name": "\\ud83d", "arguments": {}}\n</tool_call>', None),
    ("llama3_json", '{"arguments": {}, "name": "get_\\ud83d"}', None),
    # Arguments keep such a character escaped, as JSON text UTF-8 can carry.
    ("hermes", '<tool_call>\n{"arguments": {"city": "\\ud83d"}, "name": "get_weather"}'
               '\n</tool_call>', ("get_weather", {"city": "\ud83d"})),
    ("pythonic", '[get_weather(city="\\ud800")]', ("get_weather", {"city": "\ud800"})),
])
def test_a_lone_surrogate_a_model_writes_never_reaches_the_response(parser, text, call):
    """JSON's \\ud83d (and Python's) decodes to a lone surrogate, which UTF-8 cannot carry:
    a call holding one made the response's serialization fail, a 500 (a stream's error
    event said 400)."""
    whole = get_tool_parser(parser)().extract_tool_calls(text)
    streamed = _stream_parse(get_tool_parser(parser)(), text, 3)
    for content, calls in ((whole.content, whole.calls), streamed):
        for name, args in calls:
            (name + args).encode("utf-8")  # what the response must carry
        if call is None:
            assert calls == [] and text.startswith(content or "")
        else:
            assert [(n, json.loads(a)) for n, a in calls] == [call]
    assert call is not None or whole.content == text


def test_named_parser_streams_the_output_as_arguments():
    text = '{"city": "Lima", "unit": "celsius"}'
    assert NamedFunctionParser("get_weather").extract_tool_calls(text).calls == [
        ("get_weather", text)]
    assert _stream_parse(NamedFunctionParser("get_weather"), text, 4) == (
        None, [("get_weather", text)])


def test_parser_registry():
    assert sorted(TOOL_PARSERS) == ["hermes", "llama3_json", "pythonic"]
    with pytest.raises(ValueError, match="hermes, llama3_json, pythonic"):
        get_tool_parser("nope")


def test_tokenize_renders_the_tools_as_chat_completions_do(server, tokenizer):
    """/tokenize took `tools` as an unknown field and rendered the messages without them: a
    count 60+ tokens short of the chat completion's prompt (vLLM's /tokenize takes them)."""
    prompt = _render(tokenizer, FEW_SHOT)
    r = httpx.post(server.url + "/tokenize", json={"model": MODEL, "messages": FEW_SHOT,
                                                   "tools": TOOLS}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == tokenizer.encode(prompt, add_special_tokens=False)
    bad = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "name": "no spaces allowed"}}]
    r = httpx.post(server.url + "/tokenize", json={"model": MODEL, "messages": FEW_SHOT,
                                                   "tools": bad}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools.0.function.name", r.text
